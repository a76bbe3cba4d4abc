//! Hosts: RDMA queue pairs (senders) and receivers.
//!
//! A sender paces its packets at its DCQCN rate and shares its NIC port round-robin with
//! the other queue pairs on it; it keeps no window (RoCE with DCQCN is rate-based), goes
//! back to the first unacknowledged packet on a NACK or a timeout, and is done when its last
//! packet is acknowledged. A receiver delivers in order, discards anything else, ACKs every
//! `ack_every`-th packet and the last one, NACKs a gap, and sends CNPs for ECN-marked
//! packets at most once per `cnp_interval` per flow.

use super::engine::{Engine, Ev, Kind, Packet};
use crate::flows::FlowSet;
use crate::topology::{mix, NetGraph};
use orrery_des::EventQueue;
use orrery_units::Picos;

/// Per flow, where its queue pair stands among those joining its port at the same
/// picosecond (lower first; see [`Engine::start_qp`]): a hash of what the flow and the
/// rest of its collective after it look like from the flow's own source. Each flow
/// contributes its destination's offset from its source (in hosts, wrapping around the
/// fabric, and in local index inside a host, wrapping around the host); a key sums its
/// dependents' keys (those of its own collective) as a multiset. So:
/// - a shift of the hosts or of the GPUs inside every host that maps the flows onto
///   themselves maps each flow to one with the same key (a shift in blocks smaller than
///   the fabric keeps offsets only within a block), and a symmetric run is symmetric;
/// - the ring channels leaving one GPU, alike in everything but how far they are from the
///   step that leaves the host, get different keys;
/// - a collective repeated (a bucket after a bucket, an all-to-all round after a round)
///   repeats its keys, so the memo's episodes repeat (what comes after the collective
///   would tell the last repeat from the others);
/// - a key does not depend on how the flows are numbered (flows with equal keys, alike
///   in all of the above, still go in flow order).
///
/// Sizes and delays are left out: they tell no ring channel from another, and with them
/// a round of unequal all-to-all sends, or the first of a collective's repeats (released
/// without a wait), would order its queue pairs otherwise than the next and not repeat in
/// the memo.
pub(super) fn tie_keys(graph: &NetGraph, flows: &FlowSet) -> Vec<u64> {
    let per_host = graph.endpoints_per_host().max(1) as u64;
    let hosts = (graph.num_endpoints() as u64 / per_host).max(1);
    let n = flows.flows.len();
    let mut below = vec![(0u64, 0u64); n];
    let mut keys = vec![0u64; n];
    for i in (0..n).rev() {
        let f = &flows.flows[i];
        let (src, dst) = (u64::from(f.src), u64::from(f.dst));
        let hop = (dst / per_host + hosts - src / per_host) % hosts;
        let local = (dst % per_host + per_host - src % per_host) % per_host;
        let (count, sum) = below[i];
        let h = mix(hop ^ mix(local ^ mix(count ^ mix(sum))));
        keys[i] = h;
        for d in &f.deps {
            if flows.flows[d.index()].collective == f.collective {
                let slot = &mut below[d.index()];
                *slot = (slot.0 + 1, slot.1.wrapping_add(mix(h)));
            }
        }
    }
    keys
}

impl Engine<'_> {
    /// A flow is released: its queue pair joins its NIC port.
    pub(super) fn release(&mut self, f: u32) {
        let now = self.now;
        self.pending_rel[f as usize] = None;
        if let Some(m) = self.memo.as_mut() {
            m.note_pending(
                f,
                super::engine::links_of(&self.flows, &self.paths, f),
                false,
            );
        }
        let fl = &mut self.flows[f as usize];
        fl.start = Picos(now.0 + self.offset.0);
        fl.released = true;
        if fl.npkts == 0 {
            fl.sender_done = true;
            self.finish_flow(f);
            return;
        }
        if self.memo.is_some() && self.memo_on_release(f) {
            return; // deferred to this instant's memoization decision
        }
        self.start_qp(f);
    }

    /// A released flow's queue pair joins its NIC port and may send now.
    ///
    /// Queue pairs that join one port at the same picosecond are served in the order of
    /// their [`tie_keys`] (flow number among equal keys), and an idle port picks its next
    /// frame once all of them are in, from a wake filed now (after every event of this
    /// picosecond already filed). Before, they were served in the order their releases
    /// were handled, which is flow number: a symmetric run then was not symmetric (on every
    /// host the lowest-numbered ring channel went first, where a shift of the hosts maps
    /// each channel to the next), and the run depended on how its flows were numbered.
    pub(super) fn start_qp(&mut self, f: u32) {
        let now = self.now;
        let fl = &mut self.flows[f as usize];
        fl.ready_at = now;
        fl.joined = now;
        let key = (fl.tie, f);
        let l = fl.src_port;
        self.ff_on_release(f);
        let port = &self.ports[l as usize];
        let mut at = port.qps.len();
        while at > 0 {
            let q = port.qps[at - 1];
            let other = &self.flows[q as usize];
            if other.joined != now || (other.tie, q) < key {
                break;
            }
            at -= 1;
        }
        let port = &mut self.ports[l as usize];
        port.qps.insert(at, f);
        if at < port.rr {
            port.rr += 1;
        }
        if !self.settle_dormant_free(l) {
            self.wake_port_at(l, now);
        }
    }

    /// Files a wake of port `l` at `t` unless one at or before `t` is pending (a later one
    /// is moved to `t`).
    fn wake_port_at(&mut self, l: u32, t: Picos) {
        match self.ports[l as usize].wake {
            Some((w, _)) if w <= t => {}
            old => {
                if let Some((_, key)) = old {
                    self.q.cancel(key);
                }
                let key = self.sched(t, Ev::PortWake(l));
                self.ports[l as usize].wake = Some((t, key));
            }
        }
    }

    /// Picks the next queue pair on host port `l` (idle, not paused) that may send now,
    /// round-robin; if every one with data is rate-limited, wakes the port when the
    /// earliest may send.
    pub(super) fn host_pick(&mut self, l: u32) {
        let now = self.now;
        let (n, rr) = {
            let port = &self.ports[l as usize];
            (port.qps.len(), port.rr)
        };
        let mut earliest: Option<Picos> = None;
        for k in 0..n {
            let i = (rr + k) % n;
            let f = self.ports[l as usize].qps[i];
            let fl = &self.flows[f as usize];
            if fl.dead || fl.snd_nxt >= fl.npkts {
                continue;
            }
            if fl.ready_at <= now {
                self.ports[l as usize].rr = (i + 1) % n;
                self.send_data(f, l);
                return;
            }
            earliest = Some(earliest.map_or(fl.ready_at, |e| e.min(fl.ready_at)));
        }
        if let Some(t) = earliest {
            self.wake_port_at(l, t);
        }
    }

    /// Sends flow `f`'s next packet on its NIC port `l`.
    fn send_data(&mut self, f: u32, l: u32) {
        let now = self.now;
        let cfg = self.cfg;
        let fl = &mut self.flows[f as usize];
        let seq = fl.snd_nxt;
        let payload = if seq + 1 == fl.npkts {
            fl.last_payload
        } else {
            cfg.mtu_payload
        };
        if fl.snd_nxt == fl.snd_una {
            fl.last_progress = now;
        }
        if seq < fl.high {
            self.stats.retransmitted_bytes += u64::from(payload);
        } else {
            fl.high = seq + 1;
        }
        fl.snd_nxt += 1;
        self.data_packets += 1;
        let frame = payload + cfg.header_bytes;
        let rate = if cfg.dcqcn { fl.rp.rate } else { fl.rp.line };
        let rate = rate.min(fl.pace_cap);
        let gap = fl.pacing_gap(u64::from(frame) + u64::from(cfg.framing_bytes), rate);
        fl.ready_at = Picos(now.0 + gap.0);
        let arm_rto = !fl.rto_pending;
        fl.rto_pending = true;
        self.bytes_sent += u64::from(payload);
        if arm_rto {
            let at = Picos(now.0.saturating_add(cfg.rto.0));
            self.sched(at, Ev::Rto(f));
        }
        let p = self.alloc(Packet::fresh(Kind::Data, f, seq, payload, frame, l));
        self.transmit(l, p);
    }

    /// Queues a control frame from flow `f`'s receiver back to its sender.
    fn send_ctrl(&mut self, f: u32, kind: Kind, seq: u64) {
        let cfg = self.cfg;
        let frame = match kind {
            Kind::Cnp => cfg.cnp_bytes,
            _ => cfg.ack_bytes,
        };
        match kind {
            Kind::Ack => self.stats.acks += 1,
            Kind::Nack => self.stats.nacks += 1,
            Kind::Cnp => self.stats.cnps += 1,
            Kind::Data => {}
        }
        let fl = &self.flows[f as usize];
        if fl.rev.1 == 0 {
            return;
        }
        let l = self.paths[fl.rev.0 as usize];
        let p = self.alloc(Packet::fresh(kind, f, seq, 0, frame, l));
        self.ports[l as usize].ctrl.push_back(p);
        self.try_send(l);
    }

    /// A packet reached the endpoint at the end of its path.
    pub(super) fn host_arrive(&mut self, p: u32) {
        let pk = self.pkts[p as usize];
        match pk.kind {
            Kind::Data => self.on_data(&pk),
            Kind::Ack => self.on_ack(pk.flow, pk.seq, false),
            Kind::Nack => self.on_ack(pk.flow, pk.seq, true),
            Kind::Cnp => self.on_cnp(pk.flow),
        }
    }

    /// Receiver: a data packet.
    fn on_data(&mut self, pk: &Packet) {
        let now = self.now;
        let cfg = self.cfg;
        let f = pk.flow;
        if pk.ecn && cfg.dcqcn {
            let fl = &mut self.flows[f as usize];
            let interval = cfg.dcqcn_params.cnp_interval.0;
            let due = fl.last_cnp.is_none_or(|t| now.0 - t.0 >= interval);
            if due {
                if fl
                    .last_cnp
                    .is_some_and(|t| now.0 - t.0 <= interval + interval / 10)
                {
                    fl.cnp_run += 1;
                } else {
                    fl.cnp_run_since = now;
                    fl.cnp_run = 0;
                }
                fl.last_cnp = Some(now);
                self.send_ctrl(f, Kind::Cnp, 0);
            }
        }
        let fl = &mut self.flows[f as usize];
        if fl.finish.is_some() {
            return;
        }
        if pk.seq == fl.rcv_nxt {
            fl.rcv_nxt += 1;
            fl.delivered += u64::from(pk.payload);
            fl.delivered_at = now;
            self.bytes_delivered += u64::from(pk.payload);
            let next = fl.rcv_nxt;
            if next == fl.npkts {
                self.send_ctrl(f, Kind::Ack, next);
                self.finish_flow(f);
            } else if next.is_multiple_of(u64::from(cfg.ack_every)) {
                self.send_ctrl(f, Kind::Ack, next);
            }
        } else if pk.seq > fl.rcv_nxt {
            // A gap: NACK its first out-of-order packet, and again whenever the sender has
            // gone back (an out-of-order packet at or before the last trigger: the resent
            // head was lost too).
            if cfg.nack && (fl.nack_trigger == u64::MAX || pk.seq <= fl.nack_trigger) {
                fl.nack_trigger = pk.seq;
                let expected = fl.rcv_nxt;
                self.send_ctrl(f, Kind::Nack, expected);
            }
        }
        // Duplicates (seq < rcv_nxt) are discarded.
    }

    /// Sender: an ACK or NACK carrying the receiver's next expected packet `n`.
    fn on_ack(&mut self, f: u32, n: u64, nack: bool) {
        let now = self.now;
        let fl = &mut self.flows[f as usize];
        if fl.sender_done || fl.dead {
            return;
        }
        if n > fl.snd_una {
            fl.snd_una = n;
            fl.last_progress = now;
            fl.retries = 0;
            if fl.snd_nxt < fl.snd_una {
                fl.snd_nxt = fl.snd_una;
            }
        }
        if nack {
            // A NACK is a response: it restarts the retransmission timer.
            fl.last_progress = now;
            if n == fl.snd_una && n < fl.snd_nxt {
                fl.snd_nxt = n;
                self.stats.go_backs += 1;
            }
        }
        if fl.snd_una >= fl.npkts {
            fl.sender_done = true;
            let l = fl.src_port as usize;
            let port = &mut self.ports[l];
            if let Some(i) = port.qps.iter().position(|&q| q == f) {
                port.qps.remove(i);
                if port.rr > i {
                    port.rr -= 1;
                }
                if port.rr >= port.qps.len() {
                    port.rr = 0;
                }
            }
            return;
        }
        if nack {
            let l = fl.src_port;
            self.try_send(l);
        }
    }

    /// Sender: a CNP (DCQCN reaction point).
    fn on_cnp(&mut self, f: u32) {
        let cfg = self.cfg;
        let now = self.now;
        let fl = &mut self.flows[f as usize];
        if !cfg.dcqcn || fl.sender_done || fl.dead {
            return;
        }
        if let Some(t) = fl.rp.on_cnp(now, &cfg.dcqcn_params) {
            self.sched(t, Ev::RpDecrease(f));
        }
    }

    pub(super) fn on_rp_decrease(&mut self, f: u32) {
        let cfg = self.cfg;
        let now = self.now;
        let fl = &mut self.flows[f as usize];
        if fl.sender_done || fl.dead {
            return;
        }
        if let Some(t) = fl.rp.on_decrease_tick(now, &cfg.dcqcn_params) {
            self.sched(t, Ev::RpIncrease(f));
        }
    }

    pub(super) fn on_rp_increase(&mut self, f: u32) {
        let cfg = self.cfg;
        let now = self.now;
        let fl = &mut self.flows[f as usize];
        if fl.sender_done || fl.dead {
            return;
        }
        if let Some(t) = fl.rp.on_increase_timer(now, &cfg.dcqcn_params) {
            self.sched(t, Ev::RpIncrease(f));
        }
    }

    /// The retransmission timer: lazily pushed back by progress, it times out only when
    /// packets are outstanding and nothing was acknowledged for `rto`.
    pub(super) fn on_rto(&mut self, f: u32) {
        let cfg = self.cfg;
        let now = self.now;
        let fl = &mut self.flows[f as usize];
        fl.rto_pending = false;
        if fl.sender_done || fl.dead || fl.snd_nxt == fl.snd_una {
            return;
        }
        let deadline = Picos(fl.last_progress.0.saturating_add(cfg.rto.0));
        if now < deadline {
            fl.rto_pending = true;
            self.sched(deadline, Ev::Rto(f));
            return;
        }
        self.stats.timeouts += 1;
        fl.retries += 1;
        if fl.retries > cfg.max_retries {
            // The queue pair errors out; its flow stays unfinished.
            fl.dead = true;
            return;
        }
        fl.snd_nxt = fl.snd_una;
        let l = fl.src_port;
        self.try_send(l);
    }
}
