//! State images: the live state of a group of flows, taken from one engine and given to
//! other flows, of the same engine or of another, through a mapping of flows and links.
//!
//! Two mechanisms end an approximation by handing simulated flows their true state, and
//! both need the same copy:
//!
//! - A broken *mirror* (see the `memo` module) takes the state of its leader: the two
//!   episodes were isolated and isomorphic, so the leader's state carried through the
//!   isomorphism is the mirror's.
//! - An aborted *memo hit* takes the state of a *replay*: a fresh engine over the same
//!   ports ([`Engine::replay`]) simulates the hit's episode alone, from its start to the
//!   instant of the intrusion. The episode was isolated until then, so the replay's state
//!   is the state the flows would have had had they been simulated all along.
//!
//! An image holds, for each mapped flow, its sender, receiver and DCQCN state and its
//! delivered packets; the busy and paused flags of the source links; every pending event
//! of those flows and links (packet arrivals with copies of the packets, port releases,
//! PFC frames, port wake-ups, timers) in the order it was scheduled, so events at equal
//! times keep their order; the packets queued at each link, in queue order; and each host
//! port's round-robin order. Applying it schedules the copies, re-enters queued data
//! packets into their switch (buffer and PFC accounting redone) and accounts every copied
//! packet as the original was accounted. A copy, queued or in flight, is admitted by the
//! next switch it enters whatever that buffer holds, so no copy is dropped. The source
//! engine must keep its event ledger.
//!
//! What an image does not carry: buffer bytes that other traffic held in a switch pool the
//! source shared. (ECN marking draws need nothing carried: they are keyed by flow, packet
//! and link, and a replay's flows keep the keys of the flows they replay.)

use super::config::PacketConfig;
use super::engine::{Engine, Ev, FlowDynamics, FlowState, Kind, Packet, Port, NO_LINK};
use super::TraceRequest;
use orrery_des::{CalendarQueue, EventQueue};
use orrery_units::Picos;
use std::collections::{HashMap, HashSet, VecDeque};

/// A pending event to copy, already mapped onto the target's flows and links.
#[derive(Debug)]
enum PendingCopy {
    Event(Picos, Ev),
    /// A host port's wake-up (the port remembers its wake event).
    Wake(Picos, u32),
    /// A packet in flight: a copy arrives at the same time.
    Arrive(Picos, Packet),
}

/// The state of a group of flows, mapped onto their targets (see the module essay).
#[derive(Debug, Default)]
pub(super) struct StateImage {
    /// Target flow, its state and the packets its source delivered.
    flows: Vec<(u32, FlowDynamics, u64)>,
    /// Target link, busy, paused.
    port_flags: Vec<(u32, bool, bool)>,
    pending: Vec<PendingCopy>,
    /// Target link, its queued control frames and data packets (data packets point at
    /// the link they entered their switch by, one hop back, so they can re-enter it).
    queued: Vec<(u32, Vec<Packet>, Vec<Packet>)>,
    /// Target host link, the target flows in its source port's order, and the flow its
    /// source port serves next.
    qps: Vec<(u32, Vec<u32>, Option<u32>)>,
}

impl Engine<'_> {
    /// The image of the source flows of `pairs` (source flow, target flow); `phi` maps a
    /// source link to its target link (links it does not map are left out).
    pub(super) fn capture(
        &mut self,
        pairs: &[(u32, u32)],
        phi: &dyn Fn(u32) -> Option<u32>,
    ) -> StateImage {
        // A capture reads ports' busy flags and copies their pending frees.
        self.settle_dormant_frees();
        let map = |l: u32| if l == NO_LINK { Some(NO_LINK) } else { phi(l) };
        let flow_map: HashMap<u32, u32> = pairs.iter().copied().collect();
        let mut img = StateImage::default();
        for &(h, g) in pairs {
            let fl = &self.flows[h as usize];
            img.flows.push((g, fl.dynamics(), fl.rcv_nxt));
        }
        // The source links of the group that map, in order of first use.
        let mut links: Vec<(u32, u32)> = Vec::new();
        let mut seen = HashSet::new();
        for &(h, _) in pairs {
            for l in self.flow_links(h) {
                if seen.insert(l) {
                    if let Some(ml) = phi(l) {
                        links.push((l, ml));
                    }
                }
            }
        }
        let link_map: HashMap<u32, u32> = links.iter().copied().collect();
        for &(l, ml) in &links {
            let p = &self.ports[l as usize];
            img.port_flags.push((ml, p.busy, p.paused));
        }
        let sources: Vec<u32> = pairs.iter().map(|p| p.0).collect();
        let source_links: Vec<u32> = links.iter().map(|l| l.0).collect();
        let positions = self.owned_positions(&sources, &source_links);
        let ledger = self.ledger.as_deref().unwrap_or(&[]);
        let pending = ledger
            .iter()
            .filter(|_| positions.is_none())
            .chain(positions.iter().flatten().map(|&i| &ledger[i as usize]))
            .filter(|e| self.q.contains(e.0));
        for &(_, t, ev) in pending {
            let on_link = |l: u32| link_map.get(&l).copied();
            let on_flow = |f: u32| flow_map.get(&f).copied();
            let copy = match ev {
                Ev::PortFree(l) => on_link(l).map(|m| PendingCopy::Event(t, Ev::PortFree(m))),
                Ev::Pause(l) => on_link(l).map(|m| PendingCopy::Event(t, Ev::Pause(m))),
                Ev::Resume(l) => on_link(l).map(|m| PendingCopy::Event(t, Ev::Resume(m))),
                Ev::PortWake(l) => on_link(l).map(|m| PendingCopy::Wake(t, m)),
                Ev::Rto(f) => on_flow(f).map(|g| PendingCopy::Event(t, Ev::Rto(g))),
                Ev::RpDecrease(f) => on_flow(f).map(|g| PendingCopy::Event(t, Ev::RpDecrease(g))),
                Ev::RpIncrease(f) => on_flow(f).map(|g| PendingCopy::Event(t, Ev::RpIncrease(g))),
                Ev::Arrive(p) => {
                    let pk = self.pkts[p as usize];
                    match (on_flow(pk.flow), map(pk.link), map(pk.in_link)) {
                        (Some(flow), Some(link), Some(in_link)) => Some(PendingCopy::Arrive(
                            t,
                            Packet {
                                flow,
                                link,
                                in_link,
                                copied: true,
                                hdrm_copy: false,
                                ..pk
                            },
                        )),
                        _ => None,
                    }
                }
                _ => None,
            };
            img.pending.extend(copy);
        }
        for &(l, ml) in &links {
            let port = &self.ports[l as usize];
            let mine = |q: &VecDeque<u32>| -> Vec<Packet> {
                q.iter()
                    .map(|&p| self.pkts[p as usize])
                    .filter_map(|pk| flow_map.get(&pk.flow).map(|&g| Packet { flow: g, ..pk }))
                    .collect()
            };
            let ctrl: Vec<Packet> = mine(&port.ctrl)
                .into_iter()
                .map(|pk| Packet {
                    link: ml,
                    in_link: map(pk.in_link).unwrap_or(NO_LINK),
                    ..pk
                })
                .collect();
            // A queued data packet re-enters its switch over the mapped ingress link.
            let data: Vec<Packet> = mine(&port.data)
                .into_iter()
                .filter_map(|pk| {
                    let in_link = map(pk.in_link).filter(|&x| x != NO_LINK)?;
                    Some(Packet {
                        link: in_link,
                        in_link: NO_LINK,
                        hop: pk.hop.saturating_sub(1),
                        copied: true,
                        hdrm_copy: false,
                        ..pk
                    })
                })
                .collect();
            if !ctrl.is_empty() || !data.is_empty() {
                img.queued.push((ml, ctrl, data));
            }
            if !port.from_switch {
                let n = port.qps.len();
                let next = (0..n).find_map(|k| flow_map.get(&port.qps[(port.rr + k) % n]).copied());
                let order = port
                    .qps
                    .iter()
                    .filter_map(|f| flow_map.get(f).copied())
                    .collect();
                img.qps.push((ml, order, next));
            }
        }
        img
    }

    /// Gives the target flows of `img` their state. Packets the sources delivered are
    /// credited as a hit's are (bytes, links, ACKs); packets in flight or queued are
    /// accounted as their copies are made. Returns the packets credited.
    pub(super) fn apply_image(&mut self, img: StateImage) -> u64 {
        // An image adds busy flags and frees to the target's ports, which must be their
        // own first (a free dormant on a target port is settled before one is added).
        self.settle_dormant_frees();
        let mut credited = 0;
        for (g, state, delivered) in img.flows.iter().cloned() {
            self.credit_packets(g, delivered);
            credited += delivered;
            self.flows[g as usize].set_dynamics(state);
        }
        for &(ml, busy, paused) in &img.port_flags {
            let p = &mut self.ports[ml as usize];
            p.busy |= busy;
            p.paused |= paused;
        }
        for copy in img.pending {
            match copy {
                PendingCopy::Event(t, ev) => {
                    self.sched(t, ev);
                }
                PendingCopy::Wake(t, ml) => {
                    let key = self.sched(t, Ev::PortWake(ml));
                    self.ports[ml as usize].wake = Some((t, key));
                }
                PendingCopy::Arrive(t, pk) => {
                    self.account_copy(&pk, true);
                    let p = self.alloc(pk);
                    self.sched(t, Ev::Arrive(p));
                }
            }
        }
        // Control frames join the mapped control queue; data at a switch re-enters it as
        // if it had just arrived over the mapped ingress link (admitted whatever the
        // buffer holds: it is a copy).
        for (ml, ctrl, data) in img.queued {
            for pk in ctrl {
                self.account_copy(&pk, false);
                let p = self.alloc(pk);
                self.ports[ml as usize].ctrl.push_back(p);
            }
            for pk in data {
                // Accounted as queued for the hop after the ingress link.
                self.account_copy(
                    &Packet {
                        hop: pk.hop + 1,
                        ..pk
                    },
                    false,
                );
                let p = self.alloc(pk);
                self.switch_arrive(p);
            }
        }
        // Each target host port lists the target flows after its own earlier queue pairs,
        // in the source port's order, and serves next the one the source serves next, so a
        // queue pair started later is served where it would have been.
        for (ml, order, next) in img.qps {
            let port = &mut self.ports[ml as usize];
            port.qps.extend(order);
            if let Some(g) = next {
                port.rr = port.qps.iter().position(|&x| x == g).unwrap_or(0);
            }
        }
        for &(g, _, _) in &img.flows {
            self.ff_on_release(g);
        }
        for &(ml, _, _) in &img.port_flags {
            self.try_send(ml);
        }
        credited
    }

    /// Accounts a copy of packet `pk` (already on its target flow) as the original was
    /// accounted: a data packet was sent and carried over every hop of its path before its
    /// current one, and over the current one too when it is on the wire (`on_wire`) rather
    /// than queued for it; an ACK in flight is counted when it arrives, so the ACKs
    /// credited with the delivered packets must not include it.
    fn account_copy(&mut self, pk: &Packet, on_wire: bool) {
        match pk.kind {
            Kind::Data => {
                self.bytes_sent += u64::from(pk.payload);
                let (start, _) = self.flows[pk.flow as usize].fwd;
                for hop in 0..pk.hop + u32::from(on_wire) {
                    let l = self.paths[(start + hop) as usize];
                    self.link_bytes[l as usize] += u64::from(pk.payload);
                }
            }
            Kind::Ack => self.stats.acks = self.stats.acks.saturating_sub(1),
            Kind::Nack | Kind::Cnp => {}
        }
    }

    /// A fresh engine over the same ports that simulates `flows` (flow `k` of the replay
    /// is `flows[k]` here) alone, each released at its release time here, without
    /// dependencies and without acceleration; it keeps the event ledger so it can be
    /// captured. Its switch buffers start with the bytes this engine's switches hold now,
    /// as background that the replay's packets add to (an estimate: the background of
    /// the past is not known). `cfg` must be this engine's configuration with
    /// acceleration off.
    pub(super) fn replay<'r>(
        &self,
        cfg: &'r PacketConfig,
        trace: &'r TraceRequest,
        flows: &[u32],
    ) -> Engine<'r> {
        let ports: Vec<Port> = self.ports.iter().map(Port::idle_copy).collect();
        let mut paths = Vec::new();
        let mut states = Vec::with_capacity(flows.len());
        let mut q = CalendarQueue::new();
        for (k, &f) in flows.iter().enumerate() {
            let fl = &self.flows[f as usize];
            let mut lay = |(start, len): (u32, u32)| {
                let at = paths.len() as u32;
                paths.extend_from_slice(&self.paths[start as usize..(start + len) as usize]);
                (at, len)
            };
            let (fwd, rev) = (lay(fl.fwd), lay(fl.rev));
            let line = self.ports[fl.src_port as usize].bw;
            states.push(FlowState::fresh(
                fl.src_port,
                fwd,
                rev,
                fl.npkts,
                fl.last_payload,
                fl.delay,
                0,
                line,
                fl.mark_key,
            ));
            if let Some(state) = states.last_mut() {
                state.tie = fl.tie;
            }
            if fl.released {
                let at = Picos(fl.start.0.saturating_sub(self.offset.0));
                q.schedule(at, Ev::Release(k as u32));
            }
        }
        let mut e = Engine::assemble(cfg, trace, ports, self.bufs.clone(), states, paths, q);
        e.ledger = Some(Vec::new());
        e
    }

    /// Processes every event before `limit` (the replay's loop).
    pub(super) fn run_until(&mut self, limit: Picos) {
        while self.q.peek_time().is_some_and(|t| t < limit) {
            let Some((t, ev)) = self.q.pop() else {
                break;
            };
            self.now = t;
            if self.dispatch(ev) {
                self.events += 1;
            }
        }
        self.settle_dormant_frees_before(limit);
    }

    /// The ledger positions that hold every pending event of `flows` and `links` (with
    /// others besides), in ledger order, or `None` to visit the whole ledger: what a
    /// capture of those flows and links (its sources) or a partition's jump must visit.
    /// See [`LedgerIndex`].
    pub(super) fn owned_positions(&mut self, flows: &[u32], links: &[u32]) -> Option<Vec<u32>> {
        let generation = self.ledger_gen;
        let ledger = self.ledger.as_deref().unwrap_or(&[]);
        let ix = &mut self.ledger_index;
        if ix.generation != Some(generation) {
            // The first capture since the ledger was last compacted: a plain scan costs no
            // more than building the index.
            ix.generation = Some(generation);
            ix.built = false;
            return None;
        }
        // Rebuilt when what was appended since outgrows what it covers, so the part
        // visited whole stays at most about half the ledger.
        if !ix.built || ledger.len() - ix.len > ix.len.max(1024) {
            ix.by_flow.clear();
            ix.by_link.clear();
            for (i, e) in ledger.iter().enumerate() {
                if !self.q.contains(e.0) {
                    continue;
                }
                match owner_of(&self.pkts, e.2) {
                    Some(Owner::Flow(f)) => ix.by_flow.entry(f).or_default().push(i as u32),
                    Some(Owner::Link(l)) => ix.by_link.entry(l).or_default().push(i as u32),
                    None => {}
                }
            }
            ix.len = ledger.len();
            ix.built = true;
        }
        let mut at: Vec<u32> = flows
            .iter()
            .filter_map(|f| ix.by_flow.get(f))
            .chain(links.iter().filter_map(|l| ix.by_link.get(l)))
            .flatten()
            .copied()
            .collect();
        at.sort_unstable();
        at.dedup();
        // What was scheduled since the index was built (the captures before this one
        // applied their images) is visited whole.
        at.extend(ix.len as u32..ledger.len() as u32);
        // The slow path it replaces, checked in every debug run (the tests'): a scan finds
        // no pending event of these flows and links that the positions leave out.
        debug_assert!(ledger.iter().enumerate().all(|(i, e)| {
            let mine = match owner_of(&self.pkts, e.2) {
                Some(Owner::Flow(f)) => flows.contains(&f),
                Some(Owner::Link(l)) => links.contains(&l),
                None => false,
            };
            !mine || !self.q.contains(e.0) || at.binary_search(&(i as u32)).is_ok()
        }));
        Some(at)
    }
}

/// What a pending event belongs to: the flow of a packet or timer, or the link of a port
/// event. These are the events a capture copies ([`LedgerIndex`]) and a partition's jump
/// postpones (`accel`); releases and the engine's own bookkeeping belong to neither.
pub(super) enum Owner {
    Flow(u32),
    Link(u32),
}

pub(super) fn owner_of(pkts: &[Packet], ev: Ev) -> Option<Owner> {
    match ev {
        Ev::Arrive(p) => pkts.get(p as usize).map(|pk| Owner::Flow(pk.flow)),
        Ev::Rto(f) | Ev::RpDecrease(f) | Ev::RpIncrease(f) => Some(Owner::Flow(f)),
        Ev::PortFree(l) | Ev::Pause(l) | Ev::Resume(l) | Ev::PortWake(l) => Some(Owner::Link(l)),
        // Listed, not matched by a wildcard, so a new kind of event must be placed.
        Ev::Release(_) | Ev::Sample | Ev::FfSample | Ev::MemoDecide | Ev::MemoFinish(_) => None,
    }
}

/// Where the ledger's pending events are, by the flow or link they belong to, for
/// [`Engine::capture`] and a partition's jump (`accel`). Each capture (a broken mirror
/// takes its leader's state) scanned the whole ledger: about 30% of an accelerated 128-GPU
/// ring all-reduce, whose 1,316 broken mirrors visited about 50M ledger entries (4.6M
/// through the index). The second visit since the ledger was last compacted builds this
/// index (the first scans: a lone visit costs no more that way), and later ones visit
/// their own events plus what was appended since.
///
/// It stays valid while the ledger is only appended to or rewritten in place (a jump
/// gives the events it moves their new keys and times where they stand, and an event
/// keeps its owner): a compaction bumps `Engine::ledger_gen`. An event popped since is still listed,
/// but every visited event is checked to be pending, as the scan does; a pending event's
/// packet is live, so the flow it was listed under is still its flow. A capture thus
/// sees exactly the events, in the order, the scan would.
#[derive(Debug, Default)]
pub(super) struct LedgerIndex {
    /// The ledger generation of the last capture.
    generation: Option<u64>,
    built: bool,
    /// Ledger entries the index covers.
    len: usize,
    by_flow: HashMap<u32, Vec<u32>>,
    by_link: HashMap<u32, Vec<u32>>,
}
