//! Calm partitions: standing queues under the ECN threshold, and queues carried through a
//! jump.
//!
//! A *quiet* partition ([`Engine::partition_quiet`]) used to need every switch egress
//! queue on its links to hold at most one packet. A partition whose queues stand deeper
//! but under their ECN thresholds (no mark can fall), with no pause and no cut pending,
//! is as safe for the short window: its flows are held back by their senders' rates and
//! by the FIFOs that serve them, and nothing changes a rate until a queue reaches its
//! threshold or a recovering flow reaches its next increase. Such a partition is *calm*.
//! What the short window cannot judge alone is where its queues are going, so a calm
//! partition's jump also asks of each of its queues (over the same samples, from the
//! queue's first sample in them to its last):
//!
//! - one drifting by no more than `queue_theta` of its link's speed, or growing without
//!   reaching its threshold before the partition's flows end even at the fastest growth
//!   its samples allow (its slope plus the slope's resolution, below), may be frozen, as
//!   in a long-window jump ([`Engine::queues_steady`]);
//! - one *draining* by more than that (with DCQCN: after a cut, the flows it serves send
//!   less than the link takes) is carried out: the jump stops a guard above empty (two
//!   sample intervals of its drain, two frames at least), and the queue loses its drift
//!   times the jump, each flow through it the share it delivers beyond its DCQCN rate
//!   (beyond what its sender adds), or its share of the delivered rates if none shows
//!   such an excess. Each of those senders moves on by what its flow delivered less what
//!   it lost; its packets upstream of the queue take the sender's numbering, and its
//!   highest-numbered packets waiting in the queue, whose numbers those took, are taken
//!   out (their buffer given back as if sent). Without it the stage of a 1F1B pipeline
//!   simulated every drain after a cut packet by packet, 37% of the partition samples
//!   that did not jump on the 405B pipeline step (at 2 us samples);
//! - one *growing* towards its threshold (with DCQCN) is *carried*: the jump stops a
//!   guard short of the time it reaches the threshold (two sample intervals of its
//!   growth, at least two frames), and the queue grows by its drift times the jump,
//!   packets of its flows appended at its tail in proportion to their delivered rates.
//!   Each of those flows' senders moves on by the packets it delivered plus the packets
//!   it added to the queue; its packets upstream of the queue take the sender's new
//!   numbering, those in or past the queue the receiver's, and the appended ones the
//!   numbers in between. The partition thaws with the queue where it would have been and
//!   marks, cuts and recovers packet by packet. What a jump carried into a queue (or out
//!   of it) is added to the queue's earlier samples too: its samples, like its flows', are
//!   kept in the partition's own time (a frozen partition records none), so a course
//!   measured before the jump is measured on after it. A jump that stopped at a recovering
//!   flow's next increase is then followed by the next one as soon as the partition is
//!   steady again, where the queue's course used to be measured afresh from the thaw (ten
//!   samples or so for a queue growing by the ACKs' share of a 400 Gb/s link; on the 405B
//!   pipeline step, 3% to 7% of its events). A flow through two carried queues, or a
//!   switch whose buffer the added packets would bring near a PFC pause (or, without
//!   PFC, near its size), holds the jump back.
//!
//! Without this, a stage of a 1F1B pipeline that receives one micro-batch while it sends
//! the previous one was simulated packet by packet until its first mark: the link into it
//! carries the incoming flow at line rate and the ACKs of its own send, and its queue
//! grows for a few hundred microseconds towards the threshold (docs/benchmarks.md).
//! Without DCQCN nothing is carried: a queue must drift by no more than `queue_theta`.
//!
//! A queue that held at most a frame at every sample tested has no course to measure and
//! is left out of the test, but only where it cannot grow: where one ingress link no
//! faster than its own feeds it, or where what the partition's flows bring it (their
//! delivered rates, as data frames and ACKs on the wire) is more than 1% under its speed
//! ([`Engine::may_outgrow_a_frame`]). Elsewhere it is tested like a deeper queue, so a
//! queue growing by a frame every few samples waits until its growth is measured.

use super::super::engine::{Engine, Kind, Packet};
use super::{FastForward, HeldBy};
use orrery_units::Picos;
use std::collections::HashMap;

/// A switch egress queue of a calm partition carried through the jump: one growing
/// towards its ECN threshold (packets appended) or one draining (packets taken out).
#[derive(Debug, Clone, Copy)]
pub(super) struct CarriedQueue {
    pub link: u32,
    /// Bytes per second: positive for a growing queue, negative for a draining one.
    pub drift: f64,
}

/// What the queues of a calm partition allow (see the module docs).
#[derive(Debug)]
pub(super) struct CalmQueues {
    /// The longest a queue holding more than a frame takes to drain at its link's speed
    /// from the deepest it may stand at the jump's end (its threshold, for one carried
    /// towards it): the jump keeps that much more tail margin, as the flows' last packets
    /// wait behind it. Zero where no queue is that deep.
    pub drain: Picos,
    /// Queues to carry, and the longest jump they allow.
    pub queues: Vec<CarriedQueue>,
    pub limit: u64,
}

/// A flow of the partition through a carried queue: the queue (its index among the
/// carried ones), its hop on the flow's path, the link the flow enters that queue's switch
/// by, and the packets the jump appends for it (a growing queue) or takes out of its
/// share (a draining one).
#[derive(Debug, Clone, Copy)]
pub(super) struct Carried {
    pub flow: u32,
    pub queue: usize,
    pub hop: u32,
    pub in_link: u32,
    pub packets: u64,
}

/// What a partition's flows bring one link at their delivered rates: bytes per second on
/// the wire (data frames and ACKs with their headers and framing), and the link every
/// packet of theirs reaches it by, if it is only one.
#[derive(Debug, Clone, Copy)]
struct Inflow {
    offered: f64,
    ingress: Option<u32>,
    one_ingress: bool,
}

/// The longest jump (picoseconds) that carries a queue drifting by `drift` bytes per
/// second (measured to `resolution`) no closer than a guard to a mark `distance` bytes
/// away: its threshold for a growing queue, empty for a draining one. The guard is two
/// sample intervals of drift (`interval` seconds), two frames at least. Fails if the
/// drift is not known to a tenth or the queue is already within the guard.
///
/// A tenth (about 2.5% at one standard error) because the queue's error after the jump is
/// that fraction of what the jump carries, and its first mark (or the moment it empties)
/// comes early or late by that fraction of the jump. A slow course waits for more samples,
/// or is simulated: on a 100 Gb/s link growing by 1% (one ACK per eight packets of another
/// flow), the growth measured from the samples then available was 22% high, the first
/// mark came about 80 us early and the flow finished 1.6% late.
fn carry_limit(
    drift: f64,
    resolution: f64,
    distance: f64,
    interval: f64,
    frame: u64,
) -> Result<u64, HeldBy> {
    let speed = drift.abs();
    if resolution > 0.1 * speed {
        return Err(HeldBy::QueueCourseUnmeasured);
    }
    let guard = (2.0 * speed * interval).max(2.0 * frame as f64);
    let secs = (distance - guard) / speed;
    if secs > 0.0 {
        Ok(Picos::from_secs_f64(secs).0)
    } else {
        Err(HeldBy::QueueAtItsLimit)
    }
}

impl Engine<'_> {
    /// Bytes of a full data frame in a switch buffer: a payload of the MTU and its headers.
    fn full_frame(&self) -> u64 {
        u64::from(self.cfg.mtu_payload + self.cfg.header_bytes)
    }

    /// The queue test of a calm partition over the last `span` samples of its queues (at
    /// least the quiet window, at most the window: the samples since the partition last
    /// changed), its flows' completions `horizon` away at the latest (see the module
    /// docs), or the test a queue failed if one holds the jump back.
    pub(super) fn calm_queues(
        &self,
        ff: &FastForward,
        links: impl Iterator<Item = u32>,
        span: usize,
        horizon: Picos,
        flows: &[u32],
        rates: &[f64],
    ) -> Result<CalmQueues, HeldBy> {
        let a = &self.cfg.accel;
        let w = ff.window;
        let m = span.clamp(3, w.max(3)) as u64;
        let frame = self.full_frame();
        let iv = a.sample_interval.as_secs_f64();
        let mut out = CalmQueues {
            drain: Picos::ZERO,
            queues: Vec::new(),
            limit: u64::MAX,
        };
        // What the flows bring each link, gathered once for the shallow queues below.
        let mut inflows: Option<HashMap<u32, Inflow>> = None;
        for l in links {
            let port = &self.ports[l as usize];
            if !port.from_switch {
                continue;
            }
            let n = ff.link_samples[l as usize];
            if n < m {
                return Err(HeldBy::QueueCourseUnmeasured);
            }
            let deepest = (1..=m)
                .map(|k| ff.queue_sample(l, k))
                .max()
                .unwrap_or(0)
                .max(port.queued);
            if deepest <= frame {
                let inflows = inflows.get_or_insert_with(|| self.inflows(flows, rates));
                if !self.may_outgrow_a_frame(l, inflows.get(&l)) {
                    continue;
                }
            }
            // A queue left standing drifts by at most `queue_theta` (or holds the jump
            // back); a carried one is made deeper below, up to its threshold.
            let drain = |depth: f64| Picos::from_secs_f64(depth / port.bw);
            out.drain = out.drain.max(drain(deepest as f64));
            if a.queue_theta == f64::INFINITY {
                // The queue test is off: every queue is frozen, as before it.
                continue;
            }
            let (drift, resolution) = self
                .queue_course(ff, l, m, frame)
                .ok_or(HeldBy::QueueCourseUnmeasured)?;
            let flat = drift.abs() <= a.queue_theta * port.bw;
            if !self.cfg.dcqcn {
                if !flat {
                    return Err(HeldBy::QueueDrifting);
                }
                continue;
            }
            if drift < 0.0 && !flat {
                // Draining: carried as far as a guard above empty. It serves its flows
                // faster than they arrive, and their delivered rate falls when it empties.
                let limit = carry_limit(drift, resolution, port.queued as f64, iv, frame)?;
                out.limit = out.limit.min(limit);
                out.queues.push(CarriedQueue { link: l, drift });
                continue;
            }
            let room = port.ecn.kmin - port.queued as f64;
            // A queue is left standing only if it could not reach its threshold before
            // the flows end even at the fastest growth its samples leave possible (the
            // drift plus its resolution). A level queue measured over a few samples may
            // still be growing: thawed a guard short of its threshold after a carried
            // jump (two frames on a 100 Gb/s link growing by 1%, 18 us of growth), it
            // looked level over the 6 us of three 2 us samples, was frozen there through
            // a second jump and never marked, and its flow finished 24% early.
            let fastest = drift + resolution;
            if fastest <= 0.0 || room / fastest >= horizon.as_secs_f64() {
                continue;
            }
            if drift <= 0.0 {
                return Err(HeldBy::QueueCourseUnmeasured);
            }
            // Growing towards the threshold: carried as far as a guard short of it.
            out.limit = out
                .limit
                .min(carry_limit(drift, resolution, room, iv, frame)?);
            out.drain = out.drain.max(drain(port.ecn.kmin));
            out.queues.push(CarriedQueue { link: l, drift });
        }
        Ok(out)
    }

    /// What partition `flows`, delivering at `rates` (bytes per second), bring each link
    /// of their data and reverse paths.
    fn inflows(&self, flows: &[u32], rates: &[f64]) -> HashMap<u32, Inflow> {
        let cfg = self.cfg;
        let payload = f64::from(cfg.mtu_payload.max(1));
        let data_wire = f64::from(cfg.mtu_payload + cfg.header_bytes + cfg.framing_bytes);
        let ack_wire =
            f64::from(cfg.ack_bytes + cfg.framing_bytes) / f64::from(cfg.ack_every.max(1));
        let mut out: HashMap<u32, Inflow> = HashMap::new();
        for (&f, &rate) in flows.iter().zip(rates) {
            let fl = &self.flows[f as usize];
            for ((start, len), wire) in [(fl.fwd, data_wire), (fl.rev, ack_wire)] {
                let path = &self.paths[start as usize..(start + len) as usize];
                for (h, &l) in path.iter().enumerate() {
                    let from = h.checked_sub(1).map(|p| path[p]);
                    let x = out.entry(l).or_insert(Inflow {
                        offered: 0.0,
                        ingress: from,
                        one_ingress: true,
                    });
                    x.offered += rate / payload * wire;
                    x.one_ingress &= from.is_some() && from == x.ingress;
                }
            }
        }
        out
    }

    /// Whether switch egress `l`, whose queue held at most a frame at every sample tested,
    /// may still be growing, given what the partition's flows bring it (`inflow`, from
    /// [`Engine::inflows`]): what reaches it could be more than it sends. A queue that
    /// grows by a frame every few samples (a 100 Gb/s link carrying one flow at line rate
    /// and, beside it, the coalesced ACKs of another: 1% more than it sends) stays within
    /// a frame over a short window, and frozen there through a jump it never marks: at
    /// 2.5 us samples the slow-drift chain's first flow finished 24% early. It may not
    /// grow if every packet through it comes in by one ingress link no faster than it (the
    /// switch passes on what one cable brings), or if what the flows bring at their
    /// delivered rates is more than 1% under its speed. Otherwise its course is tested
    /// like a deeper queue's.
    fn may_outgrow_a_frame(&self, l: u32, inflow: Option<&Inflow>) -> bool {
        let Some(x) = inflow else {
            return false; // none of the flows goes through it
        };
        let port = &self.ports[l as usize];
        let fed_by_one = x.one_ingress
            && x.ingress
                .is_some_and(|i| self.ports[i as usize].bw <= port.bw);
        !fed_by_one && x.offered > 0.99 * port.bw
    }

    /// The course of link `l`'s queue over the longest stretch of its last `m` samples
    /// (three at least) that lies on a line within two frames: its drift (the
    /// least-squares slope, bytes per second) and the least drift that slope tells apart
    /// from noise, or `None` if not even the last three samples lie on a line. A sample is
    /// off by up to a frame (a packet leaving or arriving across the sampling instant);
    /// the slope's error is that error times `sqrt(12 / (k (k^2 - 1)))` over the interval
    /// for `k` samples, and the resolution is four times that. The stretch ends where the
    /// queue's course last changed (a cut, a drain that ended), so a drain followed by a
    /// level stretch is not taken for a slow drain, nor a level stretch followed by
    /// growth for a slow growth.
    fn queue_course(&self, ff: &FastForward, l: u32, m: u64, frame: u64) -> Option<(f64, f64)> {
        let iv = self.cfg.accel.sample_interval.as_secs_f64();
        // Newest first.
        let q = |k: u64| ff.queue_sample(l, k + 1) as f64;
        let tolerance = 2.0 * frame as f64;
        (3..=m.max(3)).rev().find_map(|k| {
            let kf = k as f64;
            // Sample `j` (newest first) at time `-j` intervals.
            let mean_t = -(kf - 1.0) / 2.0;
            let mean_q = (0..k).map(q).sum::<f64>() / kf;
            let (mut cov, mut var) = (0.0, 0.0);
            for j in 0..k {
                let t = -(j as f64) - mean_t;
                cov += t * (q(j) - mean_q);
                var += t * t;
            }
            let slope = cov / var;
            let fits = (0..k).all(|j| {
                let t = -(j as f64) - mean_t;
                (q(j) - mean_q - slope * t).abs() <= tolerance
            });
            fits.then(|| {
                let resolution = 4.0 * frame as f64 * (12.0 / (kf * (kf * kf - 1.0))).sqrt() / iv;
                (slope / iv, resolution)
            })
        })
    }

    /// The packets a jump of `jump` appends to each growing queue, or takes out of each
    /// draining one, per flow through it (`flows` and their delivered `rates`, bytes per
    /// second), or `None` if a flow goes through two carried queues, the added packets
    /// would bring a switch near a PFC pause (near its buffer's size without PFC), or a
    /// flow has fewer packets waiting in a draining queue than it would lose.
    pub(super) fn plan_carry(
        &self,
        queues: &[CarriedQueue],
        flows: &[u32],
        rates: &[f64],
        jump: Picos,
    ) -> Option<Vec<Carried>> {
        let frame = self.full_frame();
        let mut through: Vec<(u32, usize, u32, f64)> = Vec::new();
        for (&f, &rate) in flows.iter().zip(rates) {
            let fl = &self.flows[f as usize];
            let (start, len) = fl.fwd;
            let mut found = None;
            for hop in 1..len {
                let l = self.paths[(start + hop) as usize];
                if let Some(q) = queues.iter().position(|g| g.link == l) {
                    if found.is_some() {
                        return None;
                    }
                    found = Some((q, hop));
                }
            }
            if let Some((q, hop)) = found {
                through.push((f, q, hop, rate));
            }
        }
        let mut carried = Vec::with_capacity(through.len());
        // Bytes added per switch and per ingress port, to check the buffer before any
        // state moves.
        let mut per_switch: Vec<(usize, u64)> = Vec::new();
        let mut per_ingress: Vec<(u32, usize, u64)> = Vec::new();
        for (q, g) in queues.iter().enumerate() {
            if g.drift < 0.0 {
                carried.extend(self.plan_drain(q, g, &through, jump)?);
                continue;
            }
            let total: f64 = through.iter().filter(|t| t.1 == q).map(|t| t.3).sum();
            if total <= 0.0 {
                return None;
            }
            let bytes = g.drift * jump.as_secs_f64();
            let sw = self.ports[g.link as usize].from as usize;
            for &(f, _, hop, rate) in through.iter().filter(|t| t.1 == q) {
                let packets = (bytes * rate / total / frame as f64).round() as u64;
                if packets == 0 {
                    continue;
                }
                let in_link = self.paths[(self.flows[f as usize].fwd.0 + hop - 1) as usize];
                carried.push(Carried {
                    flow: f,
                    queue: q,
                    hop,
                    in_link,
                    packets,
                });
                let added = packets * frame;
                match per_switch.iter_mut().find(|e| e.0 == sw) {
                    Some(e) => e.1 += added,
                    None => per_switch.push((sw, added)),
                }
                match per_ingress.iter_mut().find(|e| e.0 == in_link) {
                    Some(e) => e.2 += added,
                    None => per_ingress.push((in_link, sw, added)),
                }
            }
        }
        let cfg = self.cfg;
        for &(sw, added) in &per_switch {
            let b = &self.bufs[sw];
            if !cfg.pfc && 2 * (b.used + added * b.copies) > cfg.buffer_bytes {
                return None;
            }
        }
        if cfg.pfc {
            // Half the dynamic threshold left after the additions: the queue goes on
            // growing after the thaw, a guard's worth, before its first mark.
            for &(in_link, sw, added) in &per_ingress {
                let b = &self.bufs[sw];
                let switch_added = per_switch.iter().find(|e| e.0 == sw).map_or(0, |e| e.1);
                let free = b
                    .shared_cap
                    .saturating_sub(b.shared_used + switch_added * b.copies);
                let threshold = free as f64 * cfg.pfc_alpha;
                let port = &self.ports[in_link as usize];
                let shared = (port.in_bytes + added).saturating_sub(cfg.pfc_reserve);
                if port.in_hdrm > 0 || port.pause_sent || shared as f64 > threshold / 2.0 {
                    return None;
                }
            }
        }
        Some(carried)
    }

    /// The packets each flow through draining queue `g`, number `q` of the carried ones,
    /// loses from it over `jump` (`through`: every carried flow, its queue, the queue's hop
    /// on its path and its delivered rate): the queue's drain, shared in proportion to what
    /// each flow delivers beyond its DCQCN rate (what its sender adds), or to its delivered
    /// rate if none shows such an excess. `None` if a flow has fewer packets waiting there
    /// than that.
    fn plan_drain(
        &self,
        q: usize,
        g: &CarriedQueue,
        through: &[(u32, usize, u32, f64)],
        jump: Picos,
    ) -> Option<Vec<Carried>> {
        let frame = self.full_frame() as f64;
        let flows = || through.iter().filter(|t| t.1 == q);
        let excess = |f: u32, rate: f64| (rate - self.flows[f as usize].rp.rate).max(0.0);
        let by_excess: f64 = flows().map(|&(f, _, _, r)| excess(f, r)).sum();
        let by_rate: f64 = flows().map(|t| t.3).sum();
        let weight = |f: u32, rate: f64| {
            if by_excess > 0.0 {
                excess(f, rate) / by_excess
            } else {
                rate / by_rate
            }
        };
        let bytes = -g.drift * jump.as_secs_f64();
        let queue = &self.ports[g.link as usize].data;
        let mut out = Vec::new();
        for &(f, _, hop, rate) in flows() {
            let packets = (bytes * weight(f, rate) / frame).round() as u64;
            if packets == 0 {
                continue;
            }
            let waiting = queue
                .iter()
                .filter(|&&p| {
                    let pk = &self.pkts[p as usize];
                    pk.flow == f && pk.kind == Kind::Data
                })
                .count() as u64;
            if packets > waiting {
                return None;
            }
            let in_link = self.paths[(self.flows[f as usize].fwd.0 + hop - 1) as usize];
            out.push(Carried {
                flow: f,
                queue: q,
                hop,
                in_link,
                packets,
            });
        }
        Some(out)
    }

    /// Takes out of each draining queue the packets its flows lost in the jump
    /// ([`Engine::carry_sender`] moved each sender back by them, after its move on by what it
    /// delivered): each flow's highest-numbered packets waiting there, which after the
    /// renumbering carry the numbers its packets upstream of the queue took.
    pub(super) fn take_drained(&mut self, queues: &[CarriedQueue], carried: &[Carried]) {
        for c in carried.iter().filter(|c| queues[c.queue].drift < 0.0) {
            let link = queues[c.queue].link;
            let mut mine: Vec<(u64, u32)> = self.ports[link as usize]
                .data
                .iter()
                .filter_map(|&p| {
                    let pk = &self.pkts[p as usize];
                    (pk.flow == c.flow && pk.kind == Kind::Data).then_some((pk.seq, p))
                })
                .collect();
            mine.sort_unstable();
            let from = mine.len().saturating_sub(c.packets as usize);
            let taken: Vec<u32> = mine[from..].iter().map(|&(_, p)| p).collect();
            self.unqueue_data(link, &taken);
        }
    }

    /// Appends the carried packets to their queues, after the jump's renumbering and with
    /// `carried` holding the packets each sender moved on by ([`Engine::carry_sender`]):
    /// flow by flow in proportion, each flow's taking the numbers between its packets in
    /// or past the queue and those still upstream of it (the first upstream one's number
    /// after the receiver's move, or its sender's next packet's if none is on the way).
    pub(super) fn append_carried(
        &mut self,
        ff: &FastForward,
        queues: &[CarriedQueue],
        carried: &[Carried],
    ) {
        let cfg = self.cfg;
        let frame = cfg.mtu_payload + cfg.header_bytes;
        // The first number of each growing queue's flow's appended packets (its sender
        // moved on by them); a draining queue's flows append none.
        let first: Vec<u64> = carried
            .iter()
            .map(|c| {
                let i = c.flow as usize;
                match ff.carry_first[i] {
                    _ if queues[c.queue].drift < 0.0 => 0,
                    u64::MAX => self.flows[i].snd_nxt - c.packets,
                    u => u + ff.shift[i],
                }
            })
            .collect();
        for (q, g) in queues.iter().enumerate().filter(|(_, g)| g.drift > 0.0) {
            let mine: Vec<usize> = (0..carried.len())
                .filter(|&k| carried[k].queue == q && carried[k].packets > 0)
                .collect();
            let mut placed = vec![0u64; mine.len()];
            let total: u64 = mine.iter().map(|&k| carried[k].packets).sum();
            for _ in 0..total {
                // The flow furthest behind its share goes next (the first on ties), so
                // the flows interleave as their arrivals did.
                let j = (0..mine.len())
                    .filter(|&j| placed[j] < carried[mine[j]].packets)
                    .min_by(|&x, &y| {
                        let share =
                            |j: usize| (placed[j] as f64 + 0.5) / carried[mine[j]].packets as f64;
                        share(x).total_cmp(&share(y))
                    })
                    .expect("a packet is left to place");
                let c = carried[mine[j]];
                let seq = first[mine[j]] + placed[j];
                placed[j] += 1;
                let mut pk = Packet::fresh(Kind::Data, c.flow, seq, cfg.mtu_payload, frame, g.link);
                pk.in_link = c.in_link;
                pk.hop = c.hop;
                let p = self.alloc(pk);
                // `plan_carry` left the buffer well short of a pause or a drop.
                let queued = self.queue_data(p, c.in_link, g.link, false);
                debug_assert!(queued, "a carried packet was dropped");
            }
        }
    }
}
