//! The simulation state, the events and the event loop. Hosts ([`super::host`]) and
//! switches ([`super::switch`]) add their handlers to [`Engine`] in their own files.

use super::accel::FastForward;
use super::config::{EcnThresholds, PacketConfig};
use super::dcqcn::ReactionPoint;
use super::image::{owner_of, Owner};
use super::memo::{Memo, MemoCache};
use super::periodic::Periodic;
use super::{PacketRun, PacketStats, Sample, TraceRequest};
use crate::flow_model::{connection_numbers, flow_hash};
use crate::flows::FlowSet;
use crate::sim::{FlowOutcome, SimError, SimProgress, SimReport, PROGRESS_EVERY};
use crate::topology::NetGraph;
use crate::word_hash::WordMap;
use orrery_des::{CalendarQueue, EventKey, EventQueue};
use orrery_units::{Bandwidth, NodeId, Picos};
use std::collections::VecDeque;

/// "No link" (a packet at a host has no ingress link).
pub(super) const NO_LINK: u32 = u32::MAX;
/// Smallest ledger length worth compacting.
const LEDGER_MIN_CAP: usize = 4096;

/// What can happen. Every payload is an index into one of the engine's arenas, so an
/// event is 8 bytes and scheduling one allocates nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ev {
    /// A flow's dependencies are done and its delay has passed.
    Release(u32),
    /// The egress port of a link finished serialising a frame.
    PortFree(u32),
    /// A host port's earliest rate-limited queue pair may send now.
    PortWake(u32),
    /// A packet's last bit reached the far end of its current link.
    Arrive(u32),
    /// A PFC pause frame reached the sender of a link.
    Pause(u32),
    /// A PFC resume frame reached the sender of a link.
    Resume(u32),
    /// A flow's retransmission timer.
    Rto(u32),
    /// A flow's DCQCN rate-decrease tick.
    RpDecrease(u32),
    /// A flow's DCQCN rate-increase timer.
    RpIncrease(u32),
    /// Take a trace sample (not counted as a simulation event).
    Sample,
    /// Take a fast-forward rate sample, maybe jump (not counted as a simulation event;
    /// scheduled only with `accel.fast_forward`).
    FfSample,
    /// Decide what to do with the flows released onto idle links at this instant
    /// (`accel.memoize` only; not counted).
    MemoDecide,
    /// A memoized flow reaches its stored completion (not counted).
    MemoFinish(u32),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Data,
    Ack,
    Nack,
    Cnp,
}

/// A packet in flight or in a queue.
#[derive(Debug, Clone, Copy)]
pub(super) struct Packet {
    /// Data: packet index in its flow. ACK/NACK: the next packet the receiver expects.
    pub seq: u64,
    pub flow: u32,
    pub payload: u32,
    /// Bytes counted in buffers (payload + headers, or the control frame).
    pub frame: u32,
    /// The link the packet is on (or queued for).
    pub link: u32,
    /// The link it entered the current switch by (PFC ingress accounting).
    pub in_link: u32,
    /// Index of `link` in the packet's path (forward for data, reverse for control).
    pub hop: u32,
    pub kind: Kind,
    pub ecn: bool,
    /// A copy made by `image` (a broken mirror or a rolled-back memo hit taking its
    /// source's state) that has not entered a switch yet: the next switch admits it
    /// whatever its buffer holds (see [`Engine::switch_arrive`]).
    pub copied: bool,
    /// A copy admitted into its ingress headroom, which it extends while it is queued
    /// (`Port::in_copy_hdrm`); cleared when it leaves the queue.
    pub hdrm_copy: bool,
}

impl Packet {
    /// A packet as its sender makes it: on the first link of its path, not in a switch,
    /// unmarked, not a copy.
    pub fn fresh(kind: Kind, flow: u32, seq: u64, payload: u32, frame: u32, link: u32) -> Packet {
        Packet {
            seq,
            flow,
            payload,
            frame,
            link,
            in_link: NO_LINK,
            hop: 0,
            kind,
            ecn: false,
            copied: false,
            hdrm_copy: false,
        }
    }
}

/// One directed link: the egress port at its sender and the ingress accounting at its
/// receiver.
#[derive(Debug)]
pub(super) struct Port {
    pub from: u32,
    pub to: u32,
    pub from_switch: bool,
    pub to_switch: bool,
    /// Bytes per second.
    pub bw: f64,
    pub delay: Picos,
    pub busy: bool,
    /// Data transmission paused by PFC from the receiver.
    pub paused: bool,
    /// Control frames (ACK, NACK, CNP): strict priority, never paused, never buffered
    /// against the shared pool.
    pub ctrl: VecDeque<u32>,
    /// Switch data FIFO.
    pub data: VecDeque<u32>,
    /// Bytes in `data`.
    pub queued: u64,
    pub ecn: EcnThresholds,
    /// Host port: the queue pairs that send on it, served round-robin.
    pub qps: Vec<u32>,
    pub rr: usize,
    pub wake: Option<(Picos, EventKey)>,
    /// Ingress accounting at the receiving switch: reserved + shared bytes, headroom bytes.
    pub in_bytes: u64,
    pub in_hdrm: u64,
    pub headroom: u64,
    /// The bytes of copies (`Packet::copied`) admitted into the headroom and still queued,
    /// which extend the headroom while they are: the upstream's packets in flight when it
    /// was paused still find the room the headroom is sized for.
    pub in_copy_hdrm: u64,
    /// A pause is in force (sent, not yet resumed).
    pub pause_sent: bool,
    /// A port's free that is *dormant* (`PacketConfig::lazy_port_frees`): the port had
    /// nothing queued when its current frame started (and, at a host, no queue pair had a
    /// packet left to send), so its `PortFree` (time, key) holds its place in the event
    /// order without being filed. See [`Engine::settle_dormant_free`].
    pub dormant_free: Option<(Picos, EventKey)>,
    /// The port is on [`Engine::dormant_ports`].
    pub dormant_listed: bool,
    /// The two frame sizes last serialised here and their times (see [`Port::ser_time`]).
    pub ser_memo: [(u64, Picos); 2],
}

impl Port {
    /// The time to serialise `bytes` on this link: `ser(bytes, self.bw)`, remembered for
    /// the last two sizes. A link carries few frame sizes (data frames of the MTU one way,
    /// ACKs and CNPs for the flows of the other), and the float division and rounding of
    /// `ser` took about 8% of a reference run's instructions under callgrind. The memo
    /// starts at zero bytes, whose time is zero.
    pub fn ser_time(&mut self, bytes: u64) -> Picos {
        if self.ser_memo[0].0 == bytes {
            return self.ser_memo[0].1;
        }
        if self.ser_memo[1].0 == bytes {
            return self.ser_memo[1].1;
        }
        let dt = ser(bytes, self.bw);
        self.ser_memo = [(bytes, dt), self.ser_memo[0]];
        dt
    }

    /// The same link with nothing queued, sent or paused.
    pub fn idle_copy(&self) -> Port {
        Port {
            from: self.from,
            to: self.to,
            from_switch: self.from_switch,
            to_switch: self.to_switch,
            bw: self.bw,
            delay: self.delay,
            busy: false,
            paused: false,
            ctrl: VecDeque::new(),
            data: VecDeque::new(),
            queued: 0,
            ecn: self.ecn,
            qps: Vec::new(),
            rr: 0,
            wake: None,
            in_bytes: 0,
            in_hdrm: 0,
            in_copy_hdrm: 0,
            headroom: self.headroom,
            pause_sent: false,
            dormant_free: None,
            dormant_listed: false,
            ser_memo: self.ser_memo,
        }
    }
}

/// A switch's shared buffer.
#[derive(Debug, Clone, Copy)]
pub(super) struct SwitchBuf {
    /// Buffer minus all headroom and reserves: the pool the dynamic threshold divides.
    pub shared_cap: u64,
    pub shared_used: u64,
    /// Every data byte in the switch.
    pub used: u64,
    /// Alike switches this one stands for (the symmetry quotient's; 1 otherwise): every
    /// data byte it admits counts this many times in `shared_used` and `used`.
    pub copies: u64,
}

impl Default for SwitchBuf {
    fn default() -> SwitchBuf {
        SwitchBuf {
            shared_cap: 0,
            shared_used: 0,
            used: 0,
            copies: 1,
        }
    }
}

/// A flow: its RDMA queue pair at the sender and its receiver state.
#[derive(Debug)]
pub(super) struct FlowState {
    pub src_port: u32,
    pub fwd: (u32, u32),
    pub rev: (u32, u32),
    pub npkts: u64,
    pub last_payload: u32,
    pub delay: Picos,
    pub waiting: u32,
    pub released: bool,
    pub start: Picos,
    pub finish: Option<Picos>,
    // Sender.
    pub snd_nxt: u64,
    pub snd_una: u64,
    pub high: u64,
    pub ready_at: Picos,
    pub rp: ReactionPoint,
    pub rto_pending: bool,
    pub last_progress: Picos,
    pub retries: u32,
    pub dead: bool,
    pub sender_done: bool,
    // Receiver.
    pub rcv_nxt: u64,
    /// The out-of-order sequence number that triggered the last NACK (`u64::MAX`: none).
    pub nack_trigger: u64,
    pub last_cnp: Option<Picos>,
    /// The receiver's current run of CNPs, each sent at most a tenth of `cnp_interval`
    /// late (after the interval, at the first marked packet): since when, and how many
    /// followed the first. A flow whose run spans the fast-forward window is cut at a
    /// steady cadence, which a cut jump carries on (see the `accel` module).
    pub cnp_run_since: Picos,
    pub cnp_run: u32,
    pub delivered: u64,
    /// When the receiver last delivered a packet in order (the fast-forward's rate is the
    /// slope between two such instants).
    pub delivered_at: Picos,
    /// The flow's identity in ECN marking draws: its index in the engine that built it, and
    /// in a replay the index of the flow it replays, so a replay draws what the flow drew.
    pub mark_key: u32,
    /// Where the queue pair stands among those that join its port at the same picosecond
    /// (see [`Engine::start_qp`]): a label of the flow's shape relative to its source, so
    /// that copies of one flow in a symmetric run take the same place.
    pub tie: u64,
    /// When (local time) its queue pair joined its port.
    pub joined: Picos,
    /// The last pacing gap the sender computed: (rate's bits, frame bytes, gap). Between
    /// two DCQCN rate changes a sender sends many frames of one size at one rate, and the
    /// gap is `ser` of them, which is worth not recomputing (see [`Port::ser_time`]).
    pub gap_memo: (u64, u64, Picos),
    /// The fastest the sender may send, wire bytes per second (infinite: no cap). A flow
    /// in progress when its collective goes periodic is held to its lane's pace (see
    /// [`Engine::periodic_try_start`]).
    pub pace_cap: f64,
}

/// What of a flow's state evolves as it runs (everything but its identity, route, size
/// and release): what a broken mirror takes over from its leader.
#[derive(Debug, Clone)]
pub(super) struct FlowDynamics {
    snd_nxt: u64,
    snd_una: u64,
    high: u64,
    ready_at: Picos,
    rp: ReactionPoint,
    rto_pending: bool,
    last_progress: Picos,
    retries: u32,
    dead: bool,
    sender_done: bool,
    rcv_nxt: u64,
    nack_trigger: u64,
    last_cnp: Option<Picos>,
    cnp_run_since: Picos,
    cnp_run: u32,
    delivered: u64,
    delivered_at: Picos,
    pace_cap: f64,
}

impl FlowState {
    /// A flow not released yet, its queue pair at line rate `line` (bytes per second),
    /// drawing its ECN marks under `mark_key`.
    #[allow(clippy::too_many_arguments)]
    pub fn fresh(
        src_port: u32,
        fwd: (u32, u32),
        rev: (u32, u32),
        npkts: u64,
        last_payload: u32,
        delay: Picos,
        waiting: u32,
        line: f64,
        mark_key: u32,
    ) -> FlowState {
        FlowState {
            src_port,
            fwd,
            rev,
            npkts,
            last_payload,
            delay,
            waiting,
            released: false,
            start: Picos::ZERO,
            finish: None,
            snd_nxt: 0,
            snd_una: 0,
            high: 0,
            ready_at: Picos::ZERO,
            rp: ReactionPoint::new(line),
            rto_pending: false,
            last_progress: Picos::ZERO,
            retries: 0,
            dead: false,
            sender_done: false,
            rcv_nxt: 0,
            nack_trigger: u64::MAX,
            last_cnp: None,
            cnp_run_since: Picos::ZERO,
            cnp_run: 0,
            delivered: 0,
            delivered_at: Picos::ZERO,
            mark_key,
            tie: 0,
            joined: Picos(u64::MAX),
            gap_memo: (0, 0, Picos::ZERO),
            pace_cap: f64::INFINITY,
        }
    }

    /// The pacing gap after a frame of `bytes` sent at `rate` (bytes per second):
    /// `ser(bytes, rate)`, remembered for the last (rate, size). The memo starts at zero
    /// bytes, whose gap is zero at any rate.
    pub fn pacing_gap(&mut self, bytes: u64, rate: f64) -> Picos {
        let (bits, memo_bytes, gap) = self.gap_memo;
        if bits == rate.to_bits() && memo_bytes == bytes {
            return gap;
        }
        let gap = ser(bytes, rate);
        self.gap_memo = (rate.to_bits(), bytes, gap);
        gap
    }

    pub fn dynamics(&self) -> FlowDynamics {
        FlowDynamics {
            snd_nxt: self.snd_nxt,
            snd_una: self.snd_una,
            high: self.high,
            ready_at: self.ready_at,
            rp: self.rp.clone(),
            rto_pending: self.rto_pending,
            last_progress: self.last_progress,
            retries: self.retries,
            dead: self.dead,
            sender_done: self.sender_done,
            rcv_nxt: self.rcv_nxt,
            nack_trigger: self.nack_trigger,
            last_cnp: self.last_cnp,
            cnp_run_since: self.cnp_run_since,
            cnp_run: self.cnp_run,
            delivered: self.delivered,
            delivered_at: self.delivered_at,
            pace_cap: self.pace_cap,
        }
    }

    pub fn set_dynamics(&mut self, d: FlowDynamics) {
        self.snd_nxt = d.snd_nxt;
        self.snd_una = d.snd_una;
        self.high = d.high;
        self.ready_at = d.ready_at;
        self.rp = d.rp;
        self.rto_pending = d.rto_pending;
        self.last_progress = d.last_progress;
        self.retries = d.retries;
        self.dead = d.dead;
        self.sender_done = d.sender_done;
        self.rcv_nxt = d.rcv_nxt;
        self.nack_trigger = d.nack_trigger;
        self.last_cnp = d.last_cnp;
        self.cnp_run_since = d.cnp_run_since;
        self.cnp_run = d.cnp_run;
        self.delivered = d.delivered;
        self.delivered_at = d.delivered_at;
        self.pace_cap = d.pace_cap;
    }
}

/// The whole simulation.
#[derive(Debug)]
pub(super) struct Engine<'a> {
    pub cfg: &'a PacketConfig,
    pub q: CalendarQueue<Ev>,
    pub now: Picos,
    pub ports: Vec<Port>,
    pub bufs: Vec<SwitchBuf>,
    pub flows: Vec<FlowState>,
    pub dependents_at: Vec<u32>,
    pub dependents: Vec<u32>,
    pub paths: Vec<u32>,
    pub pkts: Vec<Packet>,
    free: Vec<u32>,
    pub unfinished: usize,
    trace: &'a TraceRequest,
    samples: Vec<Sample>,
    /// A trace sample is pending.
    trace_pending: bool,
    /// Simulated time skipped by fast-forwarding: global time = `now + offset`. Every
    /// pending event and every time kept in the state is local (`now`'s clock); only what
    /// the report shows (flow start and finish, sample and progress times) is global.
    /// Zero without fast-forwarding, and with partitioning (a partition's jump postpones
    /// its events instead).
    pub offset: Picos,
    /// Each flow's pending release event (local time, key), so a jump can keep releases
    /// at their global times.
    pub pending_rel: Vec<Option<(Picos, EventKey)>>,
    /// The flows whose release was scheduled, so that fast-forwarding scans the pending
    /// releases, not every flow, at each sample: `pending_rel` of a listed flow may be
    /// `None` again (released since) until [`Engine::scheduled_releases`] drops it.
    /// `rel_listed` marks the listed flows.
    pub(super) rel_list: Vec<u32>,
    rel_listed: Vec<bool>,
    /// Data packets sent (for the skipped-events estimate).
    pub data_packets: u64,
    /// Fast-forwarding state (`accel.fast_forward` only).
    pub ff: Option<FastForward>,
    /// Live packets (in flight or queued) of each flow.
    pub live: Vec<u32>,
    /// With partitioning: every event a jump may have to move (all but releases and
    /// samples), as scheduled; compacted to the pending ones whenever it has doubled.
    pub ledger: Option<Vec<(EventKey, Picos, Ev)>>,
    /// Ledger length that triggers a compaction in [`Engine::sched`].
    ledger_cap: usize,
    /// Bumped whenever the ledger is compacted (not when it grows, nor when a jump
    /// rewrites entries in place), so that [`super::image::LedgerIndex`] knows its
    /// positions are stale.
    pub(super) ledger_gen: u64,
    /// Where the ledger's pending events are, for captures and jumps (see its docs).
    pub(super) ledger_index: super::image::LedgerIndex,
    /// Memoization state (`accel.memoize` only).
    pub memo: Option<Memo<'a>>,
    /// Periodic extrapolation state (`accel.periodic` with `accel.memoize`).
    pub periodic: Option<Periodic>,
    /// The ports that have held a dormant free since the last
    /// [`Engine::settle_dormant_frees`] (each once, `Port::dormant_listed`).
    pub(super) dormant_ports: Vec<u32>,
    // Report counters.
    pub link_bytes: Vec<u64>,
    pub pfc_pauses: Vec<u64>,
    pub drops: u64,
    pub bytes_sent: u64,
    pub bytes_delivered: u64,
    pub events: u64,
    /// Per flow, the counted events that were its own: its packets' arrivals and its
    /// timers (see [`PacketRun::flow_events`]).
    pub flow_events: Vec<u64>,
    pub stats: PacketStats,
}

/// The links of flow `f`'s data path, first hop first (see [`links_of`]).
pub(super) fn data_links_of<'p>(
    flows: &[FlowState],
    paths: &'p [u32],
    f: u32,
) -> impl Iterator<Item = u32> + 'p {
    let (start, len) = flows[f as usize].fwd;
    paths[start as usize..(start + len) as usize]
        .iter()
        .copied()
}

/// The links of flow `f`, data path then reverse path. A free function over the two fields
/// so callers can hold other parts of the engine mutably meanwhile.
pub(super) fn links_of<'p>(
    flows: &[FlowState],
    paths: &'p [u32],
    f: u32,
) -> impl Iterator<Item = u32> + 'p {
    let fl = &flows[f as usize];
    let (a, b) = (fl.fwd, fl.rev);
    (a.0..a.0 + a.1)
        .chain(b.0..b.0 + b.1)
        .map(move |h| paths[h as usize])
}

/// Every flow's data route (`fwd`) and reverse route for ACKs, NACKs and CNPs (`rev`), as
/// `(start, len)` ranges of link ids in `paths`.
#[derive(Debug, Clone, Default)]
pub(super) struct Routes {
    pub paths: Vec<u32>,
    pub fwd: Vec<(u32, u32)>,
    pub rev: Vec<(u32, u32)>,
}

impl Routes {
    /// The routes on `graph`, with the flow model's ECMP hash so both models put a flow on
    /// the same path.
    pub fn compute(graph: &NetGraph, flows: &FlowSet) -> Result<Routes, SimError> {
        let mut dist_cache: Vec<Option<Vec<u32>>> = vec![None; graph.num_nodes()];
        let mut routes = Routes::default();
        // A route is a pure function of its ends and hash, and a communicator's k-th
        // connection between two ranks has the same hash in every collective of a job, so
        // flows that repeat one share its links in `paths` (nothing writes them in place).
        let mut known: WordMap<(u32, u32, u64), (u32, u32)> = WordMap::default();
        // Routes on which the hash chose nothing (every hop had one next hop: inside a
        // host, along a rail), which every connection between their two nodes takes.
        let mut fixed: WordMap<(u32, u32), (u32, u32)> = WordMap::default();
        let mut push = |routes: &mut Routes, s: NodeId, d: NodeId, hash: u64| {
            if let Some(&span) = fixed.get(&(s.0, d.0)) {
                return Ok(span);
            }
            if let Some(&span) = known.get(&(s.0, d.0, hash)) {
                return Ok(span);
            }
            let dist = dist_cache[d.index()].get_or_insert_with(|| graph.distances_to(d));
            let (route, chose) = graph.route_and_choice(s, d, hash, dist)?;
            let span = (routes.paths.len() as u32, route.len() as u32);
            routes.paths.extend(route.iter().map(|l| l.0));
            if chose {
                known.insert((s.0, d.0, hash), span);
            } else {
                fixed.insert((s.0, d.0), span);
            }
            Ok::<_, SimError>(span)
        };
        let connection = connection_numbers(flows);
        for (i, f) in flows.flows.iter().enumerate() {
            let s = graph.endpoint(f.src as usize)?;
            let d = graph.endpoint(f.dst as usize)?;
            let fwd = push(&mut routes, s, d, flow_hash(f.src, f.dst, connection[i]))?;
            let rev = push(&mut routes, d, s, flow_hash(f.dst, f.src, connection[i]))?;
            routes.fwd.push(fwd);
            routes.rev.push(rev);
        }
        Ok(routes)
    }

    /// Flow `f`'s data route and reverse route.
    #[inline]
    pub fn of(&self, f: usize) -> (&[u32], &[u32]) {
        let at = |(a, n): (u32, u32)| &self.paths[a as usize..(a + n) as usize];
        (at(self.fwd[f]), at(self.rev[f]))
    }
}

/// Each node's shared buffer pool (zero for an endpoint): `buffer_bytes` less the reserve
/// and headroom of every ingress port of the switch (see the `switch` module). The fluid
/// model's buffers are the same.
pub(super) fn shared_pools(cfg: &PacketConfig, graph: &NetGraph) -> Vec<u64> {
    let mut reserved = vec![0u64; graph.num_nodes()];
    for l in graph.links() {
        if graph.kind(l.to).is_switch() {
            let r = &mut reserved[l.to.index()];
            *r = r
                .saturating_add(cfg.headroom_for(l.bandwidth, l.delay))
                .saturating_add(cfg.pfc_reserve);
        }
    }
    reserved
        .into_iter()
        .map(|r| cfg.buffer_bytes.saturating_sub(r))
        .collect()
}

/// Serialisation time of `bytes` at `bw` bytes per second, rounded to the picosecond.
pub(super) fn ser(bytes: u64, bw: f64) -> Picos {
    Bandwidth(bw).time_for(bytes as f64)
}

impl<'a> Engine<'a> {
    /// Leaves in `rel_list` the flows whose release is pending, in increasing order: drops
    /// the flows released since the last call, so a call costs O(releases scheduled since
    /// the last one, plus the pending ones), not O(flows).
    pub(super) fn scheduled_releases(&mut self) {
        let (pending, listed) = (&self.pending_rel, &mut self.rel_listed);
        self.rel_list.retain(|&f| {
            let keep = pending[f as usize].is_some();
            if !keep {
                listed[f as usize] = false;
            }
            keep
        });
        self.rel_list.sort_unstable();
        // The slow path it replaces, checked in every debug run (the tests'): a scan of
        // every flow's slot.
        debug_assert!(self.rel_list.iter().copied().eq(self
            .pending_rel
            .iter()
            .enumerate()
            .filter(|(_, slot)| slot.is_some())
            .map(|(f, _)| f as u32)));
    }

    /// Builds the state: ports, buffers, routes and queue pairs. `cfg` must be sanitised.
    #[cfg(test)]
    pub fn new(
        cfg: &'a PacketConfig,
        graph: &NetGraph,
        flows: &FlowSet,
        trace: &'a TraceRequest,
        cache: Option<&'a mut MemoCache>,
    ) -> Result<Engine<'a>, SimError> {
        flows.check()?;
        let routes = Routes::compute(graph, flows)?;
        let copies = vec![1; graph.num_nodes()];
        let ties = super::host::tie_keys(graph, flows);
        Engine::with_routes(cfg, graph, flows, routes, &copies, &ties, trace, cache)
    }

    /// [`Engine::new`] on given routes (`routes.fwd[f]`, `routes.rev[f]` index
    /// `routes.paths`), with every switch buffer standing for `copies[node]` alike
    /// switches: each data byte it holds counts `copies` times against its pool (the
    /// symmetry quotient's fixed switches, see the `symmetry` module; 1 elsewhere), and
    /// flow `f`'s queue pair ordered by `ties[f]` among those joining its port together
    /// ([`super::host::tie_keys`] of the run the flows stand for).
    #[allow(clippy::too_many_arguments)]
    pub fn with_routes(
        cfg: &'a PacketConfig,
        graph: &NetGraph,
        flows: &FlowSet,
        routes: Routes,
        copies: &[u64],
        ties: &[u64],
        trace: &'a TraceRequest,
        cache: Option<&'a mut MemoCache>,
    ) -> Result<Engine<'a>, SimError> {
        flows.check()?;
        let n_nodes = graph.num_nodes();
        let mut ports = Vec::with_capacity(graph.links().len());
        for l in graph.links() {
            let from_switch = graph.kind(l.from).is_switch();
            let to_switch = graph.kind(l.to).is_switch();
            ports.push(Port {
                from: l.from.0,
                to: l.to.0,
                from_switch,
                to_switch,
                bw: l.bandwidth.0,
                delay: l.delay,
                busy: false,
                paused: false,
                ctrl: VecDeque::new(),
                data: VecDeque::new(),
                queued: 0,
                ecn: cfg.ecn_for(l.bandwidth),
                qps: Vec::new(),
                rr: 0,
                wake: None,
                in_bytes: 0,
                in_hdrm: 0,
                in_copy_hdrm: 0,
                headroom: if to_switch {
                    cfg.headroom_for(l.bandwidth, l.delay)
                } else {
                    0
                },
                pause_sent: false,
                dormant_free: None,
                dormant_listed: false,
                ser_memo: [(0, Picos::ZERO); 2],
            });
        }
        let mut bufs = vec![SwitchBuf::default(); n_nodes];
        for ((b, cap), &c) in bufs.iter_mut().zip(shared_pools(cfg, graph)).zip(copies) {
            b.shared_cap = cap;
            b.copies = c.max(1);
        }

        let Routes { paths, fwd, rev } = routes;
        let mtu = u64::from(cfg.mtu_payload);
        let mut states = Vec::with_capacity(flows.flows.len());
        let mut n_dependents = vec![0u32; flows.flows.len() + 1];
        for (i, f) in flows.flows.iter().enumerate() {
            let (fwd, rev) = (fwd[i], rev[i]);
            let src_port = paths[fwd.0 as usize];
            let bytes = f.bytes.0;
            let npkts = bytes.div_ceil(mtu);
            let last_payload = (bytes - npkts.saturating_sub(1) * mtu) as u32;
            let line = ports[src_port as usize].bw;
            for dep in &f.deps {
                n_dependents[dep.index()] += 1;
            }
            states.push(FlowState::fresh(
                src_port,
                fwd,
                rev,
                npkts,
                last_payload,
                f.delay,
                f.deps.len() as u32,
                line,
                i as u32,
            ));
            if let (Some(state), Some(&tie)) = (states.last_mut(), ties.get(i)) {
                state.tie = tie;
            }
        }
        // Dependents in CSR form (a flow listed twice as a dependency is counted twice).
        let mut dependents_at = vec![0u32; flows.flows.len() + 1];
        for i in 0..flows.flows.len() {
            dependents_at[i + 1] = dependents_at[i] + n_dependents[i];
        }
        let mut fill = dependents_at.clone();
        let mut dependents = vec![0u32; dependents_at[flows.flows.len()] as usize];
        for (i, f) in flows.flows.iter().enumerate() {
            for dep in &f.deps {
                dependents[fill[dep.index()] as usize] = i as u32;
                fill[dep.index()] += 1;
            }
        }
        // The releases filed together (the first ones here, a finishing flow's dependents
        // in `finish_flow`) are filed in tie-key order, like the queue pairs they start
        // (see `host::tie_keys`), so that what they set off downstream (frames meeting at
        // a switch in one picosecond) is filed in an order flow numbers do not decide.
        // Releases filed by two flows finishing in one picosecond still go in the order
        // those finishes were handled.
        let tie_order = |v: &mut [u32]| v.sort_by_key(|&d| (states[d as usize].tie, d));
        for i in 0..flows.flows.len() {
            let (a, b) = (dependents_at[i] as usize, dependents_at[i + 1] as usize);
            tie_order(&mut dependents[a..b]);
        }

        let n_links = ports.len();
        let mut q = CalendarQueue::new();
        let mut pending_rel = vec![None; states.len()];
        let mut ready: Vec<u32> = (0..states.len() as u32)
            .filter(|&i| states[i as usize].waiting == 0)
            .collect();
        ready.sort_by_key(|&i| (states[i as usize].delay, states[i as usize].tie, i));
        for i in ready {
            let delay = states[i as usize].delay;
            let key = q.schedule(delay, Ev::Release(i));
            pending_rel[i as usize] = Some((delay, key));
        }
        let trace_pending = trace.interval > Picos::ZERO;
        if trace_pending {
            q.schedule(Picos::ZERO, Ev::Sample);
        }
        let ff = cfg.accel.fast_forward.then(|| {
            FastForward::new(
                states.len(),
                cfg.accel.window,
                n_links,
                cfg.accel.partitioning,
            )
        });
        // Partitioned jumps postpone a partition's events and broken mirrors copy their
        // leader's, so both need the ledger of pending events.
        let ledger = ((cfg.accel.fast_forward && cfg.accel.partitioning)
            || (cfg.accel.memoize && cfg.accel.mirror))
            .then(Vec::new);
        let periodic = (cfg.accel.memoize && cfg.accel.periodic).then(|| {
            let p = Periodic::new(
                flows,
                n_links,
                cfg.accel.period_window,
                cfg.accel.period_theta,
                cfg.accel.period_gap_theta,
            );
            let p = if cfg.accel.period_own_paths {
                p.with_data_paths(|f| data_links_of(&states, &paths, f))
            } else {
                p
            };
            if cfg.accel.collective_memo {
                // Each link's digest once, not once per flow that crosses it.
                let link_words: Vec<u64> = ports
                    .iter()
                    .map(|port| {
                        let mut words = vec![u64::from(port.from), u64::from(port.to)];
                        words.extend(super::memo::link_attrs(port));
                        super::memo::hash_words(&words)
                    })
                    .collect();
                p.with_collective_memo(
                    flows,
                    |f| links_of(&states, &paths, f),
                    |l| link_words[l as usize],
                )
            } else {
                p
            }
        });
        let memo = cfg.accel.memoize.then(|| {
            let mut m = Memo::new(cfg, flows, n_links, cache);
            m.set_buffer_copies(copies);
            for (f, slot) in pending_rel.iter().enumerate() {
                if slot.is_some() {
                    m.note_pending(f as u32, links_of(&states, &paths, f as u32), true);
                }
            }
            m
        });
        let mut e = Engine::assemble(cfg, trace, ports, bufs, states, paths, q);
        e.trace_pending = trace_pending;
        e.dependents_at = dependents_at;
        e.dependents = dependents;
        for (f, slot) in pending_rel.iter().enumerate() {
            if slot.is_some() {
                e.rel_listed[f] = true;
                e.rel_list.push(f as u32);
            }
        }
        e.pending_rel = pending_rel;
        e.ff = ff;
        e.ledger = ledger;
        e.periodic = periodic;
        e.memo = memo;
        Ok(e)
    }

    /// An engine over `ports`, `bufs` and `flows` (routes in `paths`) with the events of
    /// `q`: no dependencies, no acceleration, no ledger, nothing counted yet.
    pub fn assemble(
        cfg: &'a PacketConfig,
        trace: &'a TraceRequest,
        ports: Vec<Port>,
        bufs: Vec<SwitchBuf>,
        flows: Vec<FlowState>,
        paths: Vec<u32>,
        q: CalendarQueue<Ev>,
    ) -> Engine<'a> {
        let (n_links, n_flows) = (ports.len(), flows.len());
        Engine {
            cfg,
            q,
            now: Picos::ZERO,
            ports,
            bufs,
            unfinished: n_flows,
            flows,
            dependents_at: vec![0; n_flows + 1],
            dependents: Vec::new(),
            paths,
            pkts: Vec::new(),
            free: Vec::new(),
            trace,
            samples: Vec::new(),
            trace_pending: false,
            offset: Picos::ZERO,
            pending_rel: vec![None; n_flows],
            rel_list: Vec::new(),
            rel_listed: vec![false; n_flows],
            data_packets: 0,
            ff: None,
            live: vec![0; n_flows],
            ledger: None,
            ledger_cap: LEDGER_MIN_CAP,
            ledger_gen: 0,
            ledger_index: Default::default(),
            memo: None,
            periodic: None,
            dormant_ports: Vec::new(),
            link_bytes: vec![0; n_links],
            pfc_pauses: vec![0; n_links],
            drops: 0,
            bytes_sent: 0,
            bytes_delivered: 0,
            events: 0,
            flow_events: vec![0; n_flows],
            stats: PacketStats::default(),
        }
    }

    /// Runs until no event is left, reporting progress every [`PROGRESS_EVERY`] events.
    pub fn run(mut self, progress: &mut dyn FnMut(SimProgress)) -> Result<PacketRun, SimError> {
        let total = self.flows.len();
        while let Some((t, ev)) = self.q.pop() {
            if self.events.is_multiple_of(PROGRESS_EVERY) {
                progress(SimProgress {
                    now: Picos(t.0 + self.offset.0),
                    flows_done: total - self.unfinished,
                    flows_total: total,
                    events: self.events,
                });
            }
            self.now = t;
            // Before the dispatch: an arrival may free its packet.
            let owner = owner_of(&self.pkts, ev);
            if self.dispatch(ev) {
                self.events += 1;
                if let Some(Owner::Flow(f)) = owner {
                    self.flow_events[f as usize] += 1;
                }
            }
        }
        self.stats.clamped_schedules = self.q.clamped_schedules();
        let unfinished = self.flows.iter().filter(|f| f.finish.is_none()).count();
        if unfinished > 0 {
            return Err(SimError::Unfinished { unfinished });
        }
        let outcomes: Vec<FlowOutcome> = self
            .flows
            .iter()
            .map(|f| FlowOutcome {
                start: f.start,
                finish: f.finish.unwrap_or(f.start),
            })
            .collect();
        let end = crate::sim::last_finish(&outcomes);
        Ok(PacketRun {
            report: SimReport {
                model: "packet".to_string(),
                flows: outcomes,
                end,
                link_bytes: self.link_bytes,
                pfc_pauses: self.pfc_pauses,
                drops: self.drops,
                bytes_sent: self.bytes_sent,
                bytes_delivered: self.bytes_delivered,
                events: self.events,
                accel: crate::sim::AccelCounts {
                    skipped_events: self.stats.total_skipped_events(),
                    memo_lookups: self.stats.memo_lookups,
                    memo_hits: self.stats.memo_hits,
                },
            },
            stats: self.stats,
            samples: self.samples,
            flow_events: self.flow_events,
            symmetry: Vec::new(),
        })
    }

    /// Handles one event at `self.now`; returns whether it counts as a simulation event
    /// (samples and acceleration bookkeeping do not).
    pub(super) fn dispatch(&mut self, ev: Ev) -> bool {
        match ev {
            Ev::Release(f) => self.release(f),
            Ev::PortFree(l) => {
                self.ports[l as usize].busy = false;
                self.try_send(l);
            }
            Ev::PortWake(l) => {
                self.ports[l as usize].wake = None;
                self.try_send(l);
            }
            Ev::Arrive(p) => self.arrive(p),
            Ev::Pause(l) => self.ports[l as usize].paused = true,
            Ev::Resume(l) => {
                self.ports[l as usize].paused = false;
                self.try_send(l);
            }
            Ev::Rto(f) => self.on_rto(f),
            Ev::RpDecrease(f) => self.on_rp_decrease(f),
            Ev::RpIncrease(f) => self.on_rp_increase(f),
            Ev::Sample => {
                self.trace_pending = false;
                self.sample();
                return false;
            }
            Ev::FfSample => {
                self.ff_sample();
                return false;
            }
            Ev::MemoDecide => {
                self.memo_decide();
                return false;
            }
            Ev::MemoFinish(f) => {
                self.memo_finish(f);
                return false;
            }
        }
        true
    }

    /// Pending trace samples (0 or 1).
    pub fn trace_pending(&self) -> usize {
        usize::from(self.trace_pending)
    }

    fn sample(&mut self) {
        // Per-flow vectors only when asked for (`TraceRequest::flows`).
        let flows = if self.trace.flows {
            &self.flows[..]
        } else {
            &[]
        };
        let s = Sample {
            time: Picos(self.now.0 + self.offset.0),
            delivered: flows.iter().map(|f| f.delivered).collect(),
            rate: flows
                .iter()
                .map(|f| {
                    let active = f.released && !f.sender_done && !f.dead;
                    if active && self.cfg.dcqcn {
                        f.rp.rate
                    } else if active {
                        f.rp.line
                    } else {
                        0.0
                    }
                })
                .collect(),
            queue: self
                .trace
                .ports
                .iter()
                .map(|l| self.ports.get(l.index()).map_or(0, |p| p.queued))
                .collect(),
        };
        self.samples.push(s);
        // Keep sampling while anything else can still happen.
        if self.unfinished > 0 && self.pending_beyond(self.ff_pending()) {
            let at = Picos(self.now.0.saturating_add(self.trace.interval.0));
            self.q.schedule(at, Ev::Sample);
            self.trace_pending = true;
        }
    }

    /// Schedules an event that belongs to a flow or a link (everything but releases and
    /// samples), recording it in the ledger with partitioning so a jump can move it.
    pub fn sched(&mut self, at: Picos, ev: Ev) -> EventKey {
        let key = self.q.schedule(at, ev);
        self.ledger_push(key, at, ev);
        key
    }

    /// Records a scheduled event in the ledger, if there is one.
    fn ledger_push(&mut self, key: EventKey, at: Picos, ev: Ev) {
        if let Some(l) = self.ledger.as_mut() {
            // Compacted to the pending events when it has doubled, amortised O(1) per
            // event (a jump skips the stale entries its scan meets).
            if l.len() >= self.ledger_cap {
                let q = &self.q;
                l.retain(|e| q.contains(e.0));
                self.ledger_cap = (2 * l.len()).max(LEDGER_MIN_CAP);
                self.ledger_gen += 1;
            }
            l.push((key, at, ev));
        }
    }

    /// Stores a packet in the arena.
    pub fn alloc(&mut self, p: Packet) -> u32 {
        self.live[p.flow as usize] += 1;
        if let Some(i) = self.free.pop() {
            self.pkts[i as usize] = p;
            i
        } else {
            self.pkts.push(p);
            (self.pkts.len() - 1) as u32
        }
    }

    /// Arena slots not holding a live packet.
    pub fn free_slots(&self) -> &[u32] {
        &self.free
    }

    pub fn release_packet(&mut self, p: u32) {
        let f = self.pkts[p as usize].flow as usize;
        self.live[f] -= 1;
        self.free.push(p);
        if self.live[f] == 0 && self.memo.is_some() {
            self.memo_maybe_idle(f as u32);
        }
    }

    /// The link at `hop` of packet `p`'s path.
    pub fn path_link(&self, p: &Packet, hop: u32) -> Option<u32> {
        let f = &self.flows[p.flow as usize];
        let (start, len) = if p.kind == Kind::Data { f.fwd } else { f.rev };
        (hop < len).then(|| self.paths[(start + hop) as usize])
    }

    /// Starts serialising packet `p` on link `l` (the port must be idle).
    pub fn transmit(&mut self, l: u32, p: u32) {
        let (frame, payload, is_data) = {
            let pk = &mut self.pkts[p as usize];
            pk.link = l;
            (pk.frame, pk.payload, pk.kind == Kind::Data)
        };
        let port = &mut self.ports[l as usize];
        port.busy = true;
        let dt = port.ser_time(u64::from(frame) + u64::from(self.cfg.framing_bytes));
        let done = Picos(self.now.0 + dt.0);
        let arrive = Picos(done.0 + port.delay.0);
        if is_data {
            self.link_bytes[l as usize] += u64::from(payload);
        }
        // A free still dormant here belongs to a frame this port was sent on top of (a
        // mirror's copied busy flag, the only way a port transmits before its own free):
        // it is due, or passed, as it would have been.
        if let Some((at, key)) = port.dormant_free.take() {
            self.drop_or_file(at, key);
        }
        if self.cfg.lazy_port_frees && !self.port_has_work(l) {
            // Nothing is queued behind this frame (and, at a host, no queue pair has a
            // packet left to send, paced or not): unless something is queued or a queue
            // pair gets packets back before the frame ends, its free will do nothing.
            let key = self.q.schedule_dormant(done, Ev::PortFree(l));
            let port = &mut self.ports[l as usize];
            port.dormant_free = Some((done, key));
            if !port.dormant_listed {
                port.dormant_listed = true;
                self.dormant_ports.push(l);
            }
            self.ledger_push(key, done, Ev::PortFree(l));
        } else {
            self.sched(done, Ev::PortFree(l));
        }
        self.sched(arrive, Ev::Arrive(p));
    }

    /// Whether a free of port `l` now would do anything: send a queued frame or, at a host
    /// port, pick a queue pair with packets left to send (or, if all of them are paced,
    /// schedule the port's wake-up). A queue pair gets packets back only through
    /// [`Engine::try_send`] of its port (its start, a NACK's or a timeout's go-back), and
    /// a frame is queued only the same way, so a dormant free is settled whenever this can
    /// turn true. Acceleration moves flows only forward, after settling every dormant free.
    fn port_has_work(&self, l: u32) -> bool {
        let port = &self.ports[l as usize];
        if !port.ctrl.is_empty() || !port.data.is_empty() {
            return true;
        }
        !port.from_switch
            && port.qps.iter().any(|&f| {
                let fl = &self.flows[f as usize];
                !fl.dead && fl.snd_nxt < fl.npkts
            })
    }

    /// Settles port `l`'s dormant free, if it has one, at the event being handled: if its
    /// place in the order has passed, it would have popped by now and found nothing to send
    /// (any work given to the port since would have woken it), so it is dropped and the
    /// port is idle; otherwise, if the port has work ([`Engine::port_has_work`]), it is
    /// filed under its place. Returns whether the port is busy.
    pub(super) fn settle_dormant_free(&mut self, l: u32) -> bool {
        let port = &mut self.ports[l as usize];
        if let Some((at, key)) = port.dormant_free {
            if self.q.has_passed(key, at) {
                self.q.cancel(key);
                port.dormant_free = None;
                port.busy = false;
            } else if self.port_has_work(l) {
                self.q.wake(key, at);
                self.ports[l as usize].dormant_free = None;
            }
        }
        self.ports[l as usize].busy
    }

    /// Drops the dormant free `key` (at `at`) if its place has passed, which it returns,
    /// or files it under its place.
    fn drop_or_file(&mut self, at: Picos, key: EventKey) -> bool {
        let passed = self.q.has_passed(key, at);
        if passed {
            self.q.cancel(key);
        } else {
            self.q.wake(key, at);
        }
        passed
    }

    /// Whether more than `others` events are pending, counting a dormant free whose place
    /// has not passed, which an eager run would hold in its queue (the samples ask whether
    /// anything but their own events is left).
    pub(super) fn pending_beyond(&self, others: usize) -> bool {
        self.q.len() > others
            || self.dormant_ports.iter().any(|&l| {
                self.ports[l as usize]
                    .dormant_free
                    .is_some_and(|(at, key)| !self.q.has_passed(key, at))
            })
    }

    /// Settles every dormant free: those whose place has passed are dropped (their ports
    /// idle), the others are filed under their places. Afterwards the queue, the ledger and
    /// every port's `busy` are exactly what they would be had no free been dormant, which
    /// is what the acceleration mechanisms that read or move pending port events (jumps,
    /// mirrors' captures and images) assume: they call this first.
    pub(super) fn settle_dormant_frees(&mut self) {
        self.settle_dormant_frees_before(Picos::ZERO);
    }

    /// [`Engine::settle_dormant_frees`] after a loop that processed every event before
    /// `limit` (a replay's [`Engine::run_until`]): a dormant free before `limit` would have
    /// popped in it, and found nothing to send (anything queued would have woken it), so it
    /// is dropped like one whose place has passed, though the loop's last event came before it.
    pub(super) fn settle_dormant_frees_before(&mut self, limit: Picos) {
        let mut ports = std::mem::take(&mut self.dormant_ports);
        for &l in &ports {
            let port = &mut self.ports[l as usize];
            port.dormant_listed = false;
            if let Some((at, key)) = port.dormant_free.take() {
                let idle = if at < limit {
                    self.q.cancel(key);
                    true
                } else {
                    self.drop_or_file(at, key)
                };
                if idle {
                    self.ports[l as usize].busy = false;
                }
            }
        }
        ports.clear();
        self.dormant_ports = ports;
    }

    /// Sends the next frame on link `l` if its port is idle: control first, then data
    /// unless paused.
    pub fn try_send(&mut self, l: u32) {
        if self.ports[l as usize].busy && self.settle_dormant_free(l) {
            return;
        }
        let port = &mut self.ports[l as usize];
        if let Some(p) = port.ctrl.pop_front() {
            self.transmit(l, p);
            return;
        }
        if port.paused {
            return;
        }
        if port.from_switch {
            if let Some(p) = port.data.pop_front() {
                self.switch_dequeue(l, p);
                self.transmit(l, p);
            }
        } else {
            self.host_pick(l);
        }
    }

    /// A packet reached the far end of its link.
    fn arrive(&mut self, p: u32) {
        let pk = self.pkts[p as usize];
        let port = &self.ports[pk.link as usize];
        if port.to_switch {
            self.switch_arrive(p);
        } else {
            self.host_arrive(p);
            self.release_packet(p);
        }
    }

    /// Marks flow `f` finished now and releases the flows waiting on it.
    pub fn finish_flow(&mut self, f: u32) {
        let fl = &mut self.flows[f as usize];
        if fl.finish.is_some() || self.periodic_hold(f) {
            return;
        }
        let fl = &mut self.flows[f as usize];
        fl.finish = Some(Picos(self.now.0 + self.offset.0));
        self.unfinished -= 1;
        self.ff_on_finish(f);
        if self.memo.is_some() {
            self.memo_on_finish(f);
            self.memo_maybe_idle(f);
            self.periodic_on_finish(f);
        }
        let (a, b) = (
            self.dependents_at[f as usize] as usize,
            self.dependents_at[f as usize + 1] as usize,
        );
        for k in a..b {
            let d = self.dependents[k] as usize;
            let dep = &mut self.flows[d];
            dep.waiting -= 1;
            if dep.waiting == 0 {
                let at = Picos(self.now.0.saturating_add(dep.delay.0));
                let key = self.q.schedule(at, Ev::Release(d as u32));
                self.pending_rel[d] = Some((at, key));
                if !self.rel_listed[d] {
                    self.rel_listed[d] = true;
                    self.rel_list.push(d as u32);
                }
                if let Some(m) = self.memo.as_mut() {
                    m.note_pending(d as u32, links_of(&self.flows, &self.paths, d as u32), true);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::flows::{collective_flows, FlowAlgorithm};
    use crate::topology::RailOptimizedSpec;
    use crate::CollectiveKind;
    use orrery_units::Bytes;

    /// Routes shared between flows that repeat a connection are each flow's own route:
    /// the slow path routes every flow by itself.
    #[test]
    fn shared_routes_are_every_flows_own() {
        let spec = RailOptimizedSpec {
            gpus_per_host: 4,
            hosts_per_pod: 2,
            spines: 3,
            ..RailOptimizedSpec::dgx_h100(4)
        };
        let g = NetGraph::rail_optimized(&spec).unwrap();
        let mut fs = FlowSet::default();
        let ranks: Vec<u32> = (0..16).collect();
        for (name, channels) in [("a", 2), ("b", 2), ("c", 4)] {
            let ring = FlowAlgorithm::Ring { channels };
            let (kind, bytes) = (CollectiveKind::AllReduce, Bytes(1 << 20));
            let step = Picos::from_nanos(2000);
            collective_flows(&mut fs, name, kind, ring, &ranks, bytes, 4, step).unwrap();
        }
        let routes = Routes::compute(&g, &fs).unwrap();
        let connection = connection_numbers(&fs);
        let (mut laid_out, mut distinct) = (0, std::collections::BTreeMap::new());
        for (i, f) in fs.flows.iter().enumerate() {
            let (fwd, rev) = routes.of(i);
            let own = |s: u32, d: u32| -> Vec<u32> {
                let hash = flow_hash(s, d, connection[i]);
                let route = g.route(s as usize, d as usize, hash).unwrap();
                route.iter().map(|l| l.0).collect()
            };
            assert_eq!(fwd, own(f.src, f.dst), "flow {i}");
            assert_eq!(rev, own(f.dst, f.src), "flow {i}");
            laid_out += fwd.len() + rev.len();
            distinct.insert((f.src, f.dst, connection[i]), fwd.len());
            distinct.insert((f.dst, f.src, connection[i]), rev.len());
        }
        // Each distinct connection's route is laid out at most once (the collectives
        // repeat theirs: the ring of four channels shares two with the others), and a
        // route on which the hash chose nothing once for all connections of its ends.
        let hash_free = fs
            .flows
            .iter()
            .enumerate()
            .flat_map(|(i, f)| [(f.src, f.dst, i), (f.dst, f.src, i)])
            .filter(|&(s, d, i)| {
                let hash = flow_hash(s, d, connection[i]);
                let (s, d) = (
                    g.endpoint(s as usize).unwrap(),
                    g.endpoint(d as usize).unwrap(),
                );
                !g.route_and_choice(s, d, hash, &g.distances_to(d))
                    .unwrap()
                    .1
            })
            .count();
        assert!(hash_free > 0 && hash_free < 2 * fs.flows.len());
        assert!(routes.paths.len() < distinct.values().sum::<usize>());
        assert!(routes.paths.len() < laid_out);
    }
}
