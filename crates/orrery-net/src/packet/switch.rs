//! Switches: store-and-forward along each flow's route, a shared buffer with per-ingress
//! PFC accounting (reserve, shared pool under a dynamic threshold, headroom), one FIFO per
//! egress port, RED/ECN marking as a packet leaves its egress queue.

use super::engine::{ser, Engine, Ev, Kind};
use orrery_units::Picos;

/// What PFC admission did with a frame arriving at a switch.
enum Admission {
    Dropped,
    Admitted,
    /// A copy taken into its ingress headroom, which its bytes extend while it is queued.
    CopyInHeadroom,
}

impl Engine<'_> {
    /// A packet reached a switch: forward it to the egress port of its next hop.
    ///
    /// A copy (`Packet::copied`: a broken mirror or a rolled-back memo hit took its
    /// source's state, `image`) is admitted at the first switch it enters whatever the
    /// buffer holds: with PFC into the headroom, past it if need be (which pauses the
    /// upstream), and without PFC past the buffer's size (later arrivals are dropped
    /// until it drains below that). The copies land all at once on top of what the
    /// target's switches already hold, which the source's packets never met, and the
    /// usual rule would drop what the source never did: it dropped 1,487 packets on the
    /// accelerated GPT 13B step on 512 GPUs, whose reference dropped none.
    pub(super) fn switch_arrive(&mut self, p: u32) {
        let pk = self.pkts[p as usize];
        let copy = pk.copied;
        let l_in = pk.link;
        let Some(out) = self.path_link(&pk, pk.hop + 1) else {
            // A path never ends at a switch; if it did, the packet has nowhere to go.
            self.release_packet(p);
            return;
        };
        {
            let pk = &mut self.pkts[p as usize];
            pk.hop += 1;
            pk.link = out;
            pk.in_link = l_in;
            pk.copied = false;
        }
        if pk.kind != Kind::Data {
            self.ports[out as usize].ctrl.push_back(p);
            self.try_send(out);
            return;
        }
        if self.queue_data(p, l_in, out, copy) {
            self.try_send(out);
        }
    }

    /// Admits data packet `p`, arrived over `l_in`, into the shared buffer of the switch
    /// and the egress queue of `out` (PFC accounting and pause, or a drop if it does not
    /// fit; a `copy` is admitted whatever the buffer holds, see [`Engine::switch_arrive`]).
    /// Returns whether it was queued; a dropped packet is released. Also how a jump's
    /// carried packets join a growing queue (the `carry` module of `accel`).
    pub(super) fn queue_data(&mut self, p: u32, l_in: u32, out: u32, copy: bool) -> bool {
        let sw = self.ports[l_in as usize].to as usize;
        let size = u64::from(self.pkts[p as usize].frame);
        if self.cfg.pfc {
            match self.ingress_admit(sw, l_in, size, copy) {
                Admission::Dropped => {
                    self.drop_packet(p);
                    return false;
                }
                Admission::Admitted => {}
                Admission::CopyInHeadroom => self.pkts[p as usize].hdrm_copy = true,
            }
            self.check_pause(sw, l_in);
        } else if !copy && self.bufs[sw].used + size * self.bufs[sw].copies > self.cfg.buffer_bytes
        {
            self.drop_packet(p);
            return false;
        }
        let b = &mut self.bufs[sw];
        b.used += size * b.copies;
        if b.used > self.stats.peak_switch_bytes {
            self.stats.peak_switch_bytes = b.used;
        }
        let port = &mut self.ports[out as usize];
        port.data.push_back(p);
        port.queued += size;
        true
    }

    /// Data packet `p`, taken off the egress queue of `l` (already out of `port.data`),
    /// gives back its bytes: the queue's, the shared buffer's and (PFC) its ingress
    /// port's, which may resume that port.
    fn leave_buffer(&mut self, l: u32, p: u32) {
        let size = u64::from(self.pkts[p as usize].frame);
        let in_link = self.pkts[p as usize].in_link;
        let hdrm_copy = std::mem::take(&mut self.pkts[p as usize].hdrm_copy);
        let port = &mut self.ports[l as usize];
        port.queued -= size;
        let sw = port.from as usize;
        let b = &mut self.bufs[sw];
        b.used = b.used.saturating_sub(size * b.copies);
        if self.cfg.pfc {
            self.ingress_remove(sw, in_link, size, hdrm_copy);
            self.check_resume(sw, in_link);
        }
    }

    /// Takes data packets `taken` (each in the egress queue of `l`, waiting) out of that
    /// queue and releases them, with their bytes given back as if sent but unmarked: how a
    /// jump takes the packets a draining queue delivered beyond what its flows sent (the
    /// `carry` module of `accel`).
    pub(super) fn unqueue_data(&mut self, l: u32, taken: &[u32]) {
        // Sorted for the membership test: a drain takes up to thousands of packets out of
        // a queue of thousands.
        let mut sorted = taken.to_vec();
        sorted.sort_unstable();
        self.ports[l as usize]
            .data
            .retain(|p| sorted.binary_search(p).is_err());
        for &p in taken {
            self.leave_buffer(l, p);
            self.release_packet(p);
        }
    }

    fn drop_packet(&mut self, p: u32) {
        self.drops += 1;
        self.release_packet(p);
    }

    /// A data packet leaves its egress queue at a switch to be transmitted on `l`: free its
    /// buffer, mark it (RED on the queue it leaves behind), maybe resume its ingress.
    pub(super) fn switch_dequeue(&mut self, l: u32, p: u32) {
        self.leave_buffer(l, p);
        let port = &self.ports[l as usize];
        let queue = port.queued as f64;
        let ecn = port.ecn;
        if self.cfg.dcqcn {
            let prob = ecn.probability(queue);
            if prob >= 1.0 || (prob > 0.0 && self.mark_draw(l, p) < prob) {
                self.pkts[p as usize].ecn = true;
                self.stats.ecn_marks += 1;
            }
        }
    }

    /// The uniform draw that decides whether data packet `p` is marked as it leaves link
    /// `l`'s queue: keyed by the packet (flow and sequence number) and the link, not drawn
    /// from a stream, so no other flow's packets can change it. A packet sent again after a
    /// go-back-N rewind draws the same number at the same link; rewinds are rare (none on
    /// the benchmarks' steps) and the queue it leaves is another one by then.
    fn mark_draw(&self, l: u32, p: u32) -> f64 {
        let pk = &self.pkts[p as usize];
        let flow = self.flows[pk.flow as usize].mark_key;
        orrery_des::keyed_unit(self.cfg.seed, [u64::from(flow), pk.seq, u64::from(l)])
    }

    /// Bytes of ingress `l`'s use beyond its reserve (its share of the pool).
    fn shared_of(&self, l: u32) -> u64 {
        self.ports[l as usize]
            .in_bytes
            .saturating_sub(self.cfg.pfc_reserve)
    }

    /// The dynamic threshold: `pfc_alpha` times the free shared pool of switch `sw`.
    fn threshold(&self, sw: usize) -> u64 {
        let b = &self.bufs[sw];
        let free = b.shared_cap.saturating_sub(b.shared_used) as f64;
        (free * self.cfg.pfc_alpha) as u64
    }

    /// PFC admission of `size` bytes arriving on ingress `l` at switch `sw`: into the
    /// reserve, else the shared pool while under the threshold, else the headroom; dropped
    /// if the headroom is full too (only if headroom is undersized), unless `always` (a
    /// copy, whose headroom bytes extend the headroom while they are in it).
    fn ingress_admit(&mut self, sw: usize, l: u32, size: u64, always: bool) -> Admission {
        let thr = self.threshold(sw);
        let shared = self.shared_of(l);
        let reserve = self.cfg.pfc_reserve;
        let port = &mut self.ports[l as usize];
        if !always && size + port.in_hdrm > port.headroom + port.in_copy_hdrm && size + shared > thr
        {
            return Admission::Dropped;
        }
        let new = port.in_bytes + size;
        if new <= reserve {
            port.in_bytes = new;
        } else if new - reserve > thr {
            port.in_hdrm += size;
            if always {
                port.in_copy_hdrm += size;
                return Admission::CopyInHeadroom;
            }
        } else {
            port.in_bytes = new;
            let b = &mut self.bufs[sw];
            b.shared_used += size.min(new - reserve) * b.copies;
        }
        Admission::Admitted
    }

    /// Removes `size` bytes of ingress `l` from switch `sw`'s accounting (headroom first).
    /// A copy that took headroom (`hdrm_copy`) takes its bytes out of the headroom's
    /// extension as it leaves.
    fn ingress_remove(&mut self, sw: usize, l: u32, size: u64, hdrm_copy: bool) {
        let shared = self.shared_of(l);
        let port = &mut self.ports[l as usize];
        let from_hdrm = port.in_hdrm.min(size);
        let from_shared = (size - from_hdrm).min(shared);
        port.in_hdrm -= from_hdrm;
        if hdrm_copy {
            port.in_copy_hdrm = port.in_copy_hdrm.saturating_sub(size);
        }
        // The extension never outgrows the headroom in use.
        port.in_copy_hdrm = port.in_copy_hdrm.min(port.in_hdrm);
        port.in_bytes = port.in_bytes.saturating_sub(size - from_hdrm);
        let b = &mut self.bufs[sw];
        b.shared_used = b.shared_used.saturating_sub(from_shared * b.copies);
    }

    /// When the frame's time to reach the upstream sender of `l`.
    fn pfc_arrival(&self, l: u32) -> Picos {
        let port = &self.ports[l as usize];
        let frame = u64::from(self.cfg.pfc_frame_bytes) + u64::from(self.cfg.framing_bytes);
        Picos(self.now.0 + ser(frame, port.bw).0 + port.delay.0)
    }

    /// Pauses the upstream of ingress `l` if it uses headroom or exceeds the threshold.
    fn check_pause(&mut self, sw: usize, l: u32) {
        let port = &self.ports[l as usize];
        if port.pause_sent {
            return;
        }
        if port.in_hdrm > 0 || self.shared_of(l) > self.threshold(sw) {
            self.ports[l as usize].pause_sent = true;
            self.pfc_pauses[l as usize] += 1;
            let at = self.pfc_arrival(l);
            self.sched(at, Ev::Pause(l));
        }
    }

    /// Resumes the upstream of ingress `l` once its headroom is empty and its shared use is
    /// `pfc_resume_offset` below the threshold (or zero).
    fn check_resume(&mut self, sw: usize, l: u32) {
        let port = &self.ports[l as usize];
        if !port.pause_sent || port.in_hdrm > 0 {
            return;
        }
        let shared = self.shared_of(l);
        if shared == 0 || shared + self.cfg.pfc_resume_offset <= self.threshold(sw) {
            self.ports[l as usize].pause_sent = false;
            let at = self.pfc_arrival(l);
            self.sched(at, Ev::Resume(l));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::engine::{Engine, Kind, Packet, NO_LINK};
    use super::super::{PacketConfig, TraceRequest};
    use crate::flows::{FlowSet, FlowSpec};
    use crate::topology::NetGraph;
    use orrery_units::{Bandwidth, Bytes, Picos};

    /// A data packet of flow 0 arriving at the switch over its first link.
    fn arriving(e: &Engine<'_>, seq: u64) -> Packet {
        let pk = Packet::fresh(Kind::Data, 0, seq, 1000, 1062, NO_LINK);
        let link = e.path_link(&pk, 0).expect("the flow has a first hop");
        Packet { link, ..pk }
    }

    /// With the ingress headroom full and the shared pool used up, an arriving packet is
    /// dropped, and a copy (`image`) is not.
    #[test]
    fn a_copy_is_admitted_where_an_arrival_would_be_dropped() {
        let cfg = PacketConfig::reference().sanitized();
        let graph = NetGraph::single_switch(
            2,
            Bandwidth::from_gbits_per_sec(100.0),
            Picos::from_micros(1),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let flows = FlowSet {
            flows: vec![FlowSpec {
                src: 0,
                dst: 1,
                bytes: Bytes(1 << 20),
                deps: Default::default(),
                delay: Picos::ZERO,
                collective: 0,
            }],
            collectives: Vec::new(),
        };
        let trace = TraceRequest::default();
        let mut e =
            Engine::new(&cfg, &graph, &flows, &trace, None).unwrap_or_else(|e| panic!("{e}"));
        let l_in = arriving(&e, 0).link;
        let sw = e.ports[l_in as usize].to as usize;
        // The pool is used up (so the dynamic threshold is zero) and the ingress holds
        // its reserve, pool share and a full headroom.
        let buf = &mut e.bufs[sw];
        buf.shared_used = buf.shared_cap;
        let port = &mut e.ports[l_in as usize];
        port.in_bytes = cfg.pfc_reserve + 4096;
        port.in_hdrm = port.headroom;
        // The egress port is busy, so what is admitted stays queued.
        let out = e.path_link(&arriving(&e, 0), 1).expect("a second hop");
        e.ports[out as usize].busy = true;
        let pk = arriving(&e, 0);
        let p = e.alloc(pk);
        e.switch_arrive(p);
        assert_eq!(e.drops, 1, "the usual rule drops it");
        let hdrm = e.ports[l_in as usize].in_hdrm;
        let pk = Packet {
            copied: true,
            ..arriving(&e, 1)
        };
        let p = e.alloc(pk);
        e.switch_arrive(p);
        assert_eq!(e.drops, 1, "the copy is not dropped");
        assert_eq!(
            e.ports[l_in as usize].in_hdrm,
            hdrm + 1062,
            "it is in the headroom"
        );
        assert!(e.ports[l_in as usize].pause_sent, "its upstream is paused");
        assert_eq!(
            e.ports[out as usize].data.len(),
            1,
            "queued for its next hop"
        );
        assert!(
            !e.pkts[p as usize].copied,
            "the next switch admits it as usual"
        );
        // Room for one more frame in the headroom, which a second copy takes. Its bytes
        // extend the headroom: the frame the upstream had in flight still finds that
        // room, and the next one is dropped as before.
        let port = &mut e.ports[l_in as usize];
        port.in_hdrm = port.headroom - 1062;
        port.in_copy_hdrm = 0;
        let p = e.alloc(Packet {
            copied: true,
            ..arriving(&e, 2)
        });
        e.switch_arrive(p);
        let p = e.alloc(arriving(&e, 3));
        e.switch_arrive(p);
        assert_eq!(e.drops, 1, "the room the copy took is given back");
        let p = e.alloc(arriving(&e, 4));
        e.switch_arrive(p);
        assert_eq!(e.drops, 2, "no more than that");
        // Once the queued copies have left, the headroom is its own size again.
        while let Some(q) = e.ports[out as usize].data.pop_front() {
            e.switch_dequeue(out, q);
        }
        assert_eq!(e.ports[l_in as usize].in_copy_hdrm, 0);
    }
}
