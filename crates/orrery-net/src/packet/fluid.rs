//! # The fluid model: the packet model's fabric, with bytes as a fluid
//!
//! The packet model ([`super::PacketSimulator`]) spends its events on packets; where flows
//! collide, DCQCN keeps them in a transient (marks, cuts, a PFC-held queue, recovery) for
//! milliseconds, and no steady state lets its fast-forward skip them. This model follows
//! the same fabric, under the same [`PacketConfig`], with each flow's bytes as a fluid
//! moved in fixed time steps (`step`, 250 ns by default, or the shortest link delay if
//! that is shorter): what it keeps from the packet model is what decides a congested
//! flow's course.
//!
//! - **Queue pairs and NICs.** A flow sends from its release at its DCQCN rate (line rate
//!   without DCQCN), on the wire with the packet model's headers and framing; the flows
//!   of one NIC port share it by water-filling under their rates (the port's round-robin
//!   among the queue pairs allowed to send), after the port's control frames.
//! - **Switches.** Every switch egress port is a FIFO of the bytes that entered it, step
//!   by step (one segment per step, with each flow's share), served at the link's speed
//!   less its control frames: a flow leaves a queue in the order its bytes entered, so a
//!   flow's last bytes wait behind the queue ahead of them, as its last packets would.
//!   Links carry bytes for their propagation delay (rounded down to whole steps, at least
//!   one; the rest is added back to each completion). A switch holds bytes as the packet model's buffer
//!   does (frames without framing): per ingress port, a reserve and the shared pool under
//!   the dynamic threshold, and a PFC pause sent upstream (arriving a frame's time plus
//!   the link's delay later) when the port's shared use passes the threshold, a resume
//!   when it falls `pfc_resume_offset` under it or to zero.
//! - **ECN and DCQCN.** Bytes leaving an egress queue are marked with the RED probability
//!   of the queue they leave behind, as the packet model marks a packet as it leaves.
//!   Marks are counted in expectation (packets times probability): a flow's receiver
//!   sends a CNP when the expected marked packets that reached it since it last could
//!   send one reach pi/4 ([`FIRST_MARK`], where the first of random marks falls on
//!   average), at most once per `cnp_interval` and at that point within the step; the
//!   CNP reaches the sender the reverse path's delay later. The sender's rate is the packet model's own
//!   [`ReactionPoint`], driven through its CNPs, decrease ticks and increase timers at
//!   their exact times.
//! - **ACKs.** Each delivered data packet sends an ACK back along the reverse path; the
//!   ACKs take their bytes from every link of that path first (control frames have strict
//!   priority), one step after the data they acknowledge.
//! - **Completion.** A flow finishes when its last byte reaches the receiver (interpolated
//!   within the step), plus one frame's serialisation per switch it crosses (the packet
//!   model stores and forwards whole frames; a fluid is cut through).
//!
//! Simplified (approximations of the packet model, on purpose): marks are expectations,
//! not draws, so a receiver sends its CNP when a marked packet is due on average rather
//! than at the first marked packet a draw gives; rates change on step boundaries; a paused
//! port's in-flight bytes count against the shared pool rather than its headroom; CNPs and
//! PFC frames take no bandwidth; a flow's ACKs load its reverse path at once rather than
//! hop by hop; there are no drops, retransmissions or timeouts (PFC is assumed, as in the
//! defaults). Time is integer picoseconds at step boundaries and in every reported time;
//! the fluid amounts are `f64`. The model is deterministic: no random numbers at all. Its
//! report counts the steps it took as its events (idle stretches, skipped, count none).
//!
//! What it does not do: it does not replace the packet model where packets matter (a few
//! packets per flow, losses without PFC, a mark's draw deciding a race), and it steps
//! every active flow every step: its cost is the steps during which flows are in flight
//! times the hops they occupy, whatever they are doing (idle stretches, with nothing in
//! flight, are skipped). It does not accelerate the packet model; it is the measured
//! candidate for the course of a congested partition that the packet model's fast-forward
//! cannot jump (docs/benchmarks.md).

use super::config::{EcnThresholds, PacketConfig};
use super::dcqcn::ReactionPoint;
use super::engine::Routes;
use crate::flows::FlowSet;
use crate::sim::{FlowOutcome, FlowSimulator, SimError, SimProgress, SimReport, PROGRESS_EVERY};
use crate::topology::NetGraph;
use orrery_units::{Picos, PICOS_PER_SEC};
use std::collections::VecDeque;

/// Simulated time past which a run that has not finished is reported unfinished (a PFC
/// deadlock on a cyclic route, or a configuration that starves a flow).
const TIME_LIMIT: Picos = Picos(1_000_000_000_000_000);
/// Wire bytes below which a flow or a queue counts as empty (float dust).
const DUST: f64 = 1e-6;
/// The expected marked packets at which a receiver sends its CNP. Marks are random draws in
/// the packet model, each packet marked with the probability of the queue it leaves, so the
/// first marked packet comes when the expected count `L(t)` passes a random threshold
/// (P(no mark by t) = exp(-L(t))). Where a queue grows through its ECN threshold the
/// probability rises linearly, `L` grows as `t^2`, and the first mark comes on average at
/// `L = pi / 4`; at a steady probability it would be at 1, and above `kmax` every packet
/// is marked, where the threshold does not matter. On the 8-to-1 incast example (100
/// Gb/s, 4 MiB each) the reference's first cuts came at 15 to 28 us (19.8 on average),
/// the fluid's at 22.4 us with a threshold of 1 and its end 1.4% late, 0.37% with `pi / 4`
/// (docs/benchmarks.md).
const FIRST_MARK: f64 = std::f64::consts::FRAC_PI_4;

/// The fluid model under the packet model's configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct FluidSimulator {
    /// The fabric: buffers, PFC, ECN, DCQCN, packet sizes (the acceleration settings are
    /// not used).
    pub config: PacketConfig,
    /// The time step. Default 250 ns (a dozen 1,000-byte frames at 400 Gb/s).
    pub step: Picos,
}

impl Default for FluidSimulator {
    fn default() -> Self {
        FluidSimulator {
            config: PacketConfig::default(),
            step: Picos(250_000),
        }
    }
}

impl FlowSimulator for FluidSimulator {
    fn name(&self) -> &'static str {
        "fluid"
    }

    fn simulate(&self, graph: &NetGraph, flows: &FlowSet) -> Result<SimReport, SimError> {
        self.simulate_with_progress(graph, flows, &mut |_| {})
    }

    fn simulate_with_progress(
        &self,
        graph: &NetGraph,
        flows: &FlowSet,
        progress: &mut dyn FnMut(SimProgress),
    ) -> Result<SimReport, SimError> {
        flows.check()?;
        let routes = Routes::compute(graph, flows)?;
        let cfg = self.config.sanitized();
        // No step longer than the shortest link delay: a link holds its bytes for whole
        // steps (rounded down), and the rest is added back to each completion, which must
        // never fall before the step that delivers it (its dependents cannot start in the
        // past).
        let shortest = graph
            .links()
            .iter()
            .map(|l| l.delay.0)
            .filter(|&d| d > 0)
            .min()
            .unwrap_or(u64::MAX);
        let step = self.step.0.clamp(1, shortest.max(1));
        let mut fluid = Fluid::new(&cfg, step, graph, flows, &routes);
        fluid.run(progress)?;
        Ok(fluid.report())
    }
}

/// Some bytes of one flow, on the hop `hop` of its data path.
#[derive(Debug, Clone, Copy)]
struct Part {
    flow: u32,
    hop: u32,
    wire: f64,
    /// When, as fractions of its step, the part's first and last bytes cross the link
    /// (its bytes spread evenly in between): what a completion is interpolated on, and
    /// the earliest a FIFO can pass the part on.
    begin: f64,
    end: f64,
}

/// One directed link: its transmitter (a NIC port or a switch egress port), its FIFO when
/// a switch sends on it, the bytes in flight on it, and its PFC state as an ingress.
#[derive(Debug)]
struct Link {
    /// Wire bytes it carries per step.
    cap: f64,
    delay_steps: usize,
    to: u32,
    from_switch: bool,
    to_switch: bool,
    ecn: EcnThresholds,
    /// Wire bytes waiting in the egress FIFO, and the FIFO itself: segments (parts count,
    /// wire bytes, the step they entered in) over the parts in entry order.
    queued: f64,
    segs: VecDeque<(u32, f64, u64)>,
    parts: VecDeque<Part>,
    /// Parts that entered the FIFO this step (one segment at the step's end).
    arriving: Vec<Part>,
    /// Bytes in flight: `ring[k & (ring.len() - 1)]` lands at step `k` (a power of two of
    /// slots, more than the delay's steps, so a slot is found without a division).
    ring: Vec<Vec<Part>>,
    in_flight: usize,
    /// The flows whose first hop this is (a NIC port's queue pairs).
    qps: Vec<u32>,
    /// Control wire bytes this step and next (ACKs, with strict priority).
    ctrl: f64,
    ctrl_next: f64,
    /// As an ingress of a switch: buffered bytes that came in by it, whether it has paused
    /// its transmitter, and the pauses and resumes on their way to the transmitter.
    in_bytes: f64,
    pause_sent: bool,
    paused: bool,
    pause_changes: VecDeque<(u64, bool)>,
    /// Steps from a pause or resume being sent to its reaching the transmitter: the
    /// pause frame's serialisation and the link's delay.
    pause_lag: u64,
    pauses: u64,
    /// Whether the link is in the active list.
    listed: bool,
}

#[derive(Debug)]
struct FlowState {
    fwd: (u32, u32),
    rev: (u32, u32),
    deps_left: u32,
    delay: Picos,
    release: Option<Picos>,
    finish: Option<Picos>,
    /// Payload bytes, and the same with every packet's headers and framing.
    bytes: u64,
    wire_total: f64,
    wire_sent: f64,
    wire_delivered: f64,
    rp: ReactionPoint,
    /// CNPs on their way to the sender, by arrival time.
    cnps: VecDeque<Picos>,
    increase_at: Option<Picos>,
    decrease_at: Option<Picos>,
    /// When the receiver last sent a CNP, and the marked packets (expected) that reached
    /// it since it could send the next.
    last_cnp: Option<Picos>,
    marks: f64,
    /// Delay from leaving hop `h`'s queue to the receiver, per hop, and the reverse path's
    /// delay (CNP travel time).
    rest_delay: Vec<Picos>,
    rev_delay: Picos,
    /// What the completion adds to the fluid's arrival: store-and-forward serialisation and
    /// the rounding of link delays to steps.
    finish_extra: i64,
}

struct Fluid<'a> {
    cfg: &'a PacketConfig,
    dt: u64,
    links: Vec<Link>,
    paths: Vec<u32>,
    flows: Vec<FlowState>,
    dependents: Vec<Vec<u32>>,
    /// Per switch node: shared-pool capacity and use (buffered bytes).
    shared_cap: Vec<f64>,
    shared_used: Vec<f64>,
    /// Releases not yet taken, as (time, flow), and the active links.
    releases: std::collections::BTreeSet<(Picos, u32)>,
    active: Vec<u32>,
    senders: usize,
    in_flight_total: usize,
    unfinished: usize,
    steps: u64,
    /// Buffered bytes per wire byte of data, wire bytes of ACK per wire byte of data.
    buffered_per_wire: f64,
    ack_per_wire: f64,
    wire_per_packet: f64,
    /// A NIC port's queue pairs' demands: (wire bytes, flow, start and whole-step demand
    /// as fractions), kept between calls so the water-filling allocates nothing.
    nic_scratch: Vec<(f64, u32, f64, f64)>,
}

impl<'a> Fluid<'a> {
    fn new(
        cfg: &'a PacketConfig,
        dt: u64,
        graph: &NetGraph,
        flows: &FlowSet,
        routes: &Routes,
    ) -> Fluid<'a> {
        let frame = (u64::from(cfg.mtu_payload) + u64::from(cfg.header_bytes)) as f64;
        let wire_per_packet = cfg.data_wire_bytes() as f64;
        let ack_wire = (u64::from(cfg.ack_bytes) + u64::from(cfg.framing_bytes)) as f64;
        let pause_frame = (u64::from(cfg.pfc_frame_bytes) + u64::from(cfg.framing_bytes)) as f64;
        let dt_secs = dt as f64 / PICOS_PER_SEC;
        let links: Vec<Link> = graph
            .links()
            .iter()
            .map(|l| {
                let delay_steps = ((l.delay.0 / dt) as usize).max(1);
                let to_switch = graph.kind(l.to).is_switch();
                Link {
                    cap: l.bandwidth.0 * dt_secs,
                    delay_steps,
                    to: l.to.0,
                    from_switch: graph.kind(l.from).is_switch(),
                    to_switch,
                    ecn: cfg.ecn_for(l.bandwidth),
                    queued: 0.0,
                    segs: VecDeque::new(),
                    parts: VecDeque::new(),
                    arriving: Vec::new(),
                    ring: (0..(delay_steps + 1).next_power_of_two())
                        .map(|_| Vec::new())
                        .collect(),
                    in_flight: 0,
                    qps: Vec::new(),
                    ctrl: 0.0,
                    ctrl_next: 0.0,
                    in_bytes: 0.0,
                    pause_sent: false,
                    paused: false,
                    pause_changes: VecDeque::new(),
                    pause_lag: (delay_steps as u64
                        + (pause_frame / l.bandwidth.0 / dt_secs).ceil() as u64)
                        .max(1),
                    pauses: 0,
                    listed: false,
                }
            })
            .collect();
        let n_nodes = graph.num_nodes();
        let shared_cap = super::engine::shared_pools(cfg, graph)
            .into_iter()
            .map(|c| c as f64)
            .collect();
        let mut dependents = vec![Vec::new(); flows.flows.len()];
        let mut states = Vec::with_capacity(flows.flows.len());
        for (i, f) in flows.flows.iter().enumerate() {
            for d in &f.deps {
                dependents[d.index()].push(i as u32);
            }
            let (fwd, rev) = (routes.fwd[i], routes.rev[i]);
            let path = &routes.paths[fwd.0 as usize..(fwd.0 + fwd.1) as usize];
            let rpath = &routes.paths[rev.0 as usize..(rev.0 + rev.1) as usize];
            let glink = |l: u32| graph.link(orrery_units::LinkId(l));
            let mut rest_delay = vec![Picos::ZERO; path.len()];
            let mut acc = 0u64;
            for h in (0..path.len()).rev() {
                acc += glink(path[h]).delay.0;
                rest_delay[h] = Picos(acc);
            }
            let rev_delay = Picos(rpath.iter().map(|&l| glink(l).delay.0).sum());
            // Store and forward: one frame's serialisation per switch crossed; and the
            // exact delays against their rounding to steps.
            let mut extra: i64 = 0;
            for &l in &path[1..] {
                let bw = glink(l).bandwidth.0;
                extra += (wire_per_packet / bw * PICOS_PER_SEC).round() as i64;
            }
            for &l in path {
                let exact = glink(l).delay.0 as i64;
                extra += exact - (links[l as usize].delay_steps as u64 * dt) as i64;
            }
            let bytes = f.bytes.0;
            let npkts = bytes.div_ceil(u64::from(cfg.mtu_payload));
            let wire_total = bytes as f64
                + (npkts * (wire_per_packet as u64 - u64::from(cfg.mtu_payload))) as f64;
            let line = graph.link(orrery_units::LinkId(path[0])).bandwidth.0;
            states.push(FlowState {
                fwd,
                rev,
                deps_left: f.deps.len() as u32,
                delay: f.delay,
                release: None,
                finish: None,
                bytes,
                wire_total,
                wire_sent: 0.0,
                wire_delivered: 0.0,
                rp: ReactionPoint::new(line),
                cnps: VecDeque::new(),
                increase_at: None,
                decrease_at: None,
                last_cnp: None,
                marks: 0.0,
                rest_delay,
                rev_delay,
                finish_extra: extra,
            });
        }
        let mut releases = std::collections::BTreeSet::new();
        for (i, s) in states.iter_mut().enumerate() {
            if s.deps_left == 0 {
                s.release = Some(s.delay);
                releases.insert((s.delay, i as u32));
            }
        }
        let unfinished = states.len();
        Fluid {
            cfg,
            dt,
            links,
            paths: routes.paths.clone(),
            flows: states,
            dependents,
            shared_cap,
            shared_used: vec![0.0; n_nodes],
            releases,
            active: Vec::new(),
            senders: 0,
            in_flight_total: 0,
            unfinished,
            steps: 0,
            buffered_per_wire: frame / wire_per_packet,
            ack_per_wire: ack_wire / wire_per_packet / f64::from(cfg.ack_every.max(1)),
            wire_per_packet,
            nic_scratch: Vec::new(),
        }
    }

    fn path(&self, f: u32) -> &[u32] {
        let (a, n) = self.flows[f as usize].fwd;
        &self.paths[a as usize..(a + n) as usize]
    }

    fn list(&mut self, l: u32) {
        let link = &mut self.links[l as usize];
        if !link.listed {
            link.listed = true;
            self.active.push(l);
        }
    }

    fn run(&mut self, progress: &mut dyn FnMut(SimProgress)) -> Result<(), SimError> {
        let total = self.flows.len();
        let mut k: u64 = 0;
        while self.unfinished > 0 {
            // Nothing in flight, queued or sending: skip to the step of the next release.
            if self.senders == 0 && self.in_flight_total == 0 && self.nothing_queued() {
                let Some(&(t, _)) = self.releases.first() else {
                    break;
                };
                k = k.max(t.0 / self.dt);
            }
            let t = k * self.dt;
            if t > TIME_LIMIT.0 {
                break;
            }
            if self.steps.is_multiple_of(PROGRESS_EVERY) {
                progress(SimProgress {
                    now: Picos(t),
                    flows_done: total - self.unfinished,
                    flows_total: total,
                    events: self.steps,
                });
            }
            self.step(k);
            self.steps += 1;
            k += 1;
        }
        if self.unfinished > 0 {
            return Err(SimError::Unfinished {
                unfinished: self.unfinished,
            });
        }
        Ok(())
    }

    fn nothing_queued(&self) -> bool {
        self.active.iter().all(|&l| {
            let link = &self.links[l as usize];
            link.queued <= DUST && link.ctrl <= DUST && link.ctrl_next <= DUST
        })
    }

    /// One step `[k dt, (k + 1) dt)`.
    fn step(&mut self, k: u64) {
        let (t, next) = (Picos(k * self.dt), Picos((k + 1) * self.dt));
        // Rate control events up to the step's start, in time order per flow.
        if self.cfg.dcqcn {
            for i in 0..self.active.len() {
                let l = self.active[i] as usize;
                for q in 0..self.links[l].qps.len() {
                    let f = self.links[l].qps[q];
                    self.drive_rate(f, t);
                }
            }
        }
        // Pauses and resumes that reach their transmitters.
        for i in 0..self.active.len() {
            let link = &mut self.links[self.active[i] as usize];
            while let Some(&(at, paused)) = link.pause_changes.front() {
                if at > k {
                    break;
                }
                link.paused = paused;
                link.pause_changes.pop_front();
            }
        }
        // Bytes landing this step: into the next switch's egress FIFO, or delivered (a
        // completion releases its dependents at once, so they may send in this step).
        for i in 0..self.active.len() {
            let l = self.active[i];
            let slot = (k as usize) & (self.links[l as usize].ring.len() - 1);
            if self.links[l as usize].ring[slot].is_empty() {
                continue;
            }
            let mut landing = std::mem::take(&mut self.links[l as usize].ring[slot]);
            self.links[l as usize].in_flight -= landing.len();
            self.in_flight_total -= landing.len();
            if self.links[l as usize].to_switch {
                let mut added = 0.0;
                for p in &landing {
                    let out = self.path(p.flow)[p.hop as usize + 1];
                    self.links[out as usize].arriving.push(Part {
                        hop: p.hop + 1,
                        ..*p
                    });
                    added += p.wire;
                    self.list(out);
                }
                self.ingress_add(l, added * self.buffered_per_wire);
            } else {
                for p in &landing {
                    self.deliver(p, t);
                }
            }
            landing.clear();
            self.links[l as usize].ring[slot] = landing;
        }
        // Releases within the step join their NIC ports.
        while let Some(&(at, f)) = self.releases.first() {
            if at >= next {
                break;
            }
            self.releases.pop_first();
            if self.flows[f as usize].wire_total <= DUST {
                // As in the packet model, a flow with no bytes is done when released.
                self.finish(f, at);
                continue;
            }
            let first = self.path(f)[0];
            self.links[first as usize].qps.push(f);
            self.list(first);
            self.senders += 1;
        }
        // Each FIFO's arrivals of the step become one segment.
        for i in 0..self.active.len() {
            let link = &mut self.links[self.active[i] as usize];
            if link.arriving.is_empty() {
                continue;
            }
            let mut sum = 0.0;
            let n = link.arriving.len() as u32;
            for p in link.arriving.drain(..) {
                sum += p.wire;
                link.parts.push_back(p);
            }
            link.segs.push_back((n, sum, k));
            link.queued += sum;
        }
        // Every link transmits: control frames first, then data unless paused.
        let mut sent: Vec<Part> = Vec::new();
        for i in 0..self.active.len() {
            let l = self.active[i];
            let link = &self.links[l as usize];
            let room = (link.cap - link.ctrl).max(0.0);
            if link.paused || room <= 0.0 {
                continue;
            }
            sent.clear();
            if link.from_switch {
                self.serve_fifo(l, room, k, &mut sent);
            } else {
                self.serve_nic(l, room, t, &mut sent);
            }
            if sent.is_empty() {
                continue;
            }
            if self.links[l as usize].from_switch && self.cfg.dcqcn {
                self.mark(l, &sent, t);
            }
            let link = &mut self.links[l as usize];
            let land = (k as usize + link.delay_steps) & (link.ring.len() - 1);
            link.in_flight += sent.len();
            self.in_flight_total += sent.len();
            link.ring[land].extend_from_slice(&sent);
        }
        self.pfc(k);
        // Control frames: what this step's deliveries ask of the next.
        for i in 0..self.active.len() {
            let link = &mut self.links[self.active[i] as usize];
            link.ctrl = std::mem::take(&mut link.ctrl_next);
        }
        // Links with nothing left leave the active list.
        let links = &mut self.links;
        self.active.retain(|&l| {
            let link = &mut links[l as usize];
            let keep = link.in_flight > 0
                || link.queued > DUST
                || !link.qps.is_empty()
                || link.ctrl > DUST
                || link.ctrl_next > DUST
                || !link.pause_changes.is_empty()
                || link.pause_sent
                || link.paused
                || link.in_bytes > DUST;
            if !keep {
                link.listed = false;
            }
            keep
        });
    }

    /// Applies flow `f`'s CNP arrivals, decrease ticks and increase timers up to `t`, in
    /// time order (a tick before a CNP of the same instant, as the packet model files them).
    fn drive_rate(&mut self, f: u32, t: Picos) {
        let p = &self.cfg.dcqcn_params;
        let fl = &mut self.flows[f as usize];
        loop {
            let cnp = fl.cnps.front().copied();
            let Some(at) = [fl.decrease_at, fl.increase_at, cnp]
                .into_iter()
                .flatten()
                .min()
            else {
                break;
            };
            if at > t {
                break;
            }
            if Some(at) == fl.decrease_at {
                fl.decrease_at = None;
                if let Some(inc) = fl.rp.on_decrease_tick(at, p) {
                    fl.increase_at = Some(inc);
                }
            } else if Some(at) == fl.increase_at {
                fl.increase_at = fl.rp.on_increase_timer(at, p);
            } else {
                fl.cnps.pop_front();
                if let Some(dec) = fl.rp.on_cnp(at, p) {
                    fl.decrease_at = Some(dec);
                }
            }
        }
    }

    /// Serves up to `room` wire bytes of link `l`'s FIFO in step `k`, head first, into
    /// `sent`; the bytes leave their ingress ports' accounting.
    ///
    /// When each part crosses the link within the step: bytes queued before the step go
    /// back to back from its start; the step's own arrivals (its last segment) go out
    /// together after them, interleaved as they arrived, no earlier than they arrived.
    fn serve_fifo(&mut self, l: u32, room: f64, k: u64, sent: &mut Vec<Part>) {
        let link = &mut self.links[l as usize];
        let mut left = room.min(link.queued);
        let mut clock = 0.0f64;
        while left > DUST {
            let Some(&(n, total, born)) = link.segs.front() else {
                break;
            };
            let take = total.min(left);
            let share = take / total;
            let fresh = born == k;
            let (seg_begin, seg_end) = (clock, clock + take / room);
            for p in link.parts.iter_mut().take(n as usize) {
                let wire = p.wire * share;
                let (begin, end) = if fresh {
                    (seg_begin.max(p.begin), seg_end.max(p.end).min(1.0))
                } else {
                    let b = clock;
                    clock += wire / room;
                    (b, clock.min(1.0))
                };
                p.wire -= wire;
                sent.push(Part {
                    wire,
                    begin,
                    end,
                    ..*p
                });
            }
            clock = clock.max(seg_end).min(1.0);
            left -= take;
            link.queued -= take;
            if take >= total {
                link.parts.drain(..n as usize);
                link.segs.pop_front();
            } else if let Some(front) = link.segs.front_mut() {
                front.1 = total - take;
            }
        }
        if link.segs.is_empty() {
            link.queued = 0.0;
        }
        for p in sent.iter() {
            let ingress = self.path(p.flow)[p.hop as usize - 1];
            self.ingress_add(ingress, -p.wire * self.buffered_per_wire);
        }
    }

    /// Serves NIC port `l`'s queue pairs: each may send its rate's worth of the step (from
    /// its release, if that falls within it) and no more than it has left; they share the
    /// port's `room` by water-filling.
    fn serve_nic(&mut self, l: u32, room: f64, t: Picos, sent: &mut Vec<Part>) {
        let dt_secs = self.dt as f64 / PICOS_PER_SEC;
        let mut want = std::mem::take(&mut self.nic_scratch);
        want.clear();
        for &f in &self.links[l as usize].qps {
            let fl = &self.flows[f as usize];
            let from = fl.release.map_or(t, |r| r.max(t));
            let begin = (from.0 - t.0) as f64 / self.dt as f64;
            let rate = if self.cfg.dcqcn {
                fl.rp.rate
            } else {
                fl.rp.line
            };
            let full = rate * dt_secs * (1.0 - begin);
            let demand = full.min(fl.wire_total - fl.wire_sent).max(0.0);
            want.push((demand, f, begin, full));
        }
        // Water-filling: the smallest demands are met in full, the rest split what is left.
        want.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        let mut left = room;
        let mut n_left = want.len();
        let mut done = false;
        for &(demand, f, begin, full) in &want {
            let share = left / n_left as f64;
            let give = demand.min(share);
            left -= give;
            n_left -= 1;
            if give <= 0.0 {
                continue;
            }
            let fl = &mut self.flows[f as usize];
            fl.wire_sent += give;
            if fl.wire_total - fl.wire_sent <= DUST {
                fl.wire_sent = fl.wire_total;
                done = true;
            }
            // A flow held to its share spreads over the rest of the step; one that runs out
            // of bytes stops early, at its pace.
            let end = if give < demand || full <= 0.0 {
                1.0
            } else {
                (begin + (1.0 - begin) * give / full).min(1.0)
            };
            sent.push(Part {
                flow: f,
                hop: 0,
                wire: give,
                begin,
                end,
            });
        }
        // The port's queue pairs stay in the order they joined (the water-filling sorted a
        // copy); those with nothing left to send leave it.
        if done {
            let flows = &self.flows;
            let before = self.links[l as usize].qps.len();
            self.links[l as usize]
                .qps
                .retain(|&f| flows[f as usize].wire_sent < flows[f as usize].wire_total);
            self.senders -= before - self.links[l as usize].qps.len();
        }
        self.nic_scratch = want;
    }

    /// ECN on the bytes `sent` left link `l`'s queue with: each flow's receiver counts the
    /// expected marked packets that reach it while it may send a CNP, and sends one when
    /// they reach one.
    fn mark(&mut self, l: u32, sent: &[Part], t: Picos) {
        let link = &self.links[l as usize];
        let prob = link.ecn.probability(link.queued * self.buffered_per_wire);
        if prob <= 0.0 {
            return;
        }
        let interval = self.cfg.dcqcn_params.cnp_interval.0;
        let dt = self.dt as f64;
        for p in sent {
            let fl = &mut self.flows[p.flow as usize];
            let rest = fl.rest_delay[p.hop as usize].0;
            // The part leaves the queue spread over the step; its marked packets reach the
            // receiver `rest` later, where they count once the receiver may send again.
            let eligible = fl
                .last_cnp
                .map_or(0, |c| (c.0 + interval).saturating_sub(rest));
            let from = eligible.max(t.0);
            if from >= t.0 + self.dt {
                continue;
            }
            let per_ps = p.wire / self.wire_per_packet * prob / dt;
            let avail = per_ps * (t.0 + self.dt - from) as f64;
            if fl.marks + avail < FIRST_MARK {
                fl.marks += avail;
                continue;
            }
            // The marked packet that completes the threshold: the CNP leaves the receiver
            // when it arrives, within the step.
            let crossing = from + ((FIRST_MARK - fl.marks) / per_ps).round() as u64;
            let arrive = Picos(crossing.min(t.0 + self.dt) + rest);
            fl.marks = 0.0;
            fl.last_cnp = Some(arrive);
            fl.cnps.push_back(Picos(arrive.0 + fl.rev_delay.0));
        }
    }

    /// Adds `buffered` bytes (negative: removes) to what ingress `l` holds in its switch.
    fn ingress_add(&mut self, l: u32, buffered: f64) {
        let reserve = self.cfg.pfc_reserve as f64;
        let link = &mut self.links[l as usize];
        let before = (link.in_bytes - reserve).max(0.0);
        link.in_bytes = (link.in_bytes + buffered).max(0.0);
        let after = (link.in_bytes - reserve).max(0.0);
        self.shared_used[link.to as usize] += after - before;
        self.list(l);
    }

    /// PFC on every ingress that holds bytes: a pause when its shared use passes the
    /// dynamic threshold, a resume when it is `pfc_resume_offset` under it or zero, each
    /// reaching the transmitter a pause frame's time plus the link's delay later.
    fn pfc(&mut self, k: u64) {
        if !self.cfg.pfc {
            return;
        }
        let reserve = self.cfg.pfc_reserve as f64;
        for i in 0..self.active.len() {
            let l = self.active[i] as usize;
            let link = &self.links[l];
            if !link.to_switch {
                continue;
            }
            let sw = link.to as usize;
            let thr = self.cfg.pfc_alpha * (self.shared_cap[sw] - self.shared_used[sw]).max(0.0);
            let shared = (link.in_bytes - reserve).max(0.0);
            let link = &mut self.links[l];
            if !link.pause_sent && shared > thr {
                link.pause_sent = true;
                link.pauses += 1;
                link.pause_changes.push_back((k + link.pause_lag, true));
            } else if link.pause_sent
                && (shared <= DUST || shared + self.cfg.pfc_resume_offset as f64 <= thr)
            {
                link.pause_sent = false;
                link.pause_changes.push_back((k + link.pause_lag, false));
            }
        }
    }

    /// Part `p` reached its flow's receiver in the step from `t`: its ACKs load the reverse
    /// path next step, and the flow's last byte finishes it, at that byte's place within
    /// the part's span of the step.
    fn deliver(&mut self, p: &Part, t: Picos) {
        let (f, wire) = (p.flow, p.wire);
        let (a, n) = self.flows[f as usize].rev;
        let ack = wire * self.ack_per_wire;
        for h in a..a + n {
            let l = self.paths[h as usize];
            self.links[l as usize].ctrl_next += ack;
            self.list(l);
        }
        let fl = &mut self.flows[f as usize];
        let before = fl.wire_delivered;
        fl.wire_delivered += wire;
        // Summing a flow's parts, split across FIFO segments and steps, loses float dust:
        // a flow is delivered within a thousandth of a packet or a ten-millionth of itself.
        let tolerance = (1e-3 * self.wire_per_packet).max(1e-7 * fl.wire_total);
        if fl.finish.is_some() || fl.wire_delivered < fl.wire_total - tolerance {
            return;
        }
        let need = (fl.wire_total - before).clamp(0.0, wire);
        let within = p.begin + (p.end - p.begin) * if wire > 0.0 { need / wire } else { 1.0 };
        let at = t.0 as i64 + (within * self.dt as f64).round() as i64 + fl.finish_extra;
        self.finish(f, Picos(at.max(t.0 as i64) as u64));
    }

    fn finish(&mut self, f: u32, at: Picos) {
        self.flows[f as usize].finish = Some(at);
        self.unfinished -= 1;
        for k in 0..self.dependents[f as usize].len() {
            let d = self.dependents[f as usize][k] as usize;
            let dep = &mut self.flows[d];
            dep.deps_left -= 1;
            if dep.deps_left == 0 {
                let r = Picos(at.0.saturating_add(dep.delay.0));
                dep.release = Some(r);
                self.releases.insert((r, d as u32));
            }
        }
    }

    fn report(&self) -> SimReport {
        let outcomes: Vec<FlowOutcome> = self
            .flows
            .iter()
            .map(|f| {
                let start = f.release.unwrap_or(Picos::ZERO);
                FlowOutcome {
                    start,
                    finish: f.finish.unwrap_or(start),
                }
            })
            .collect();
        let end = crate::sim::last_finish(&outcomes);
        let mut link_bytes = vec![0u64; self.links.len()];
        let mut total = 0u64;
        for (i, f) in self.flows.iter().enumerate() {
            total += f.bytes;
            for &l in self.path(i as u32) {
                link_bytes[l as usize] += f.bytes;
            }
        }
        SimReport {
            model: "fluid".to_string(),
            flows: outcomes,
            end,
            link_bytes,
            pfc_pauses: self.links.iter().map(|l| l.pauses).collect(),
            drops: 0,
            bytes_sent: total,
            bytes_delivered: total,
            events: self.steps,
            accel: Default::default(),
        }
    }
}
