//! Steady-state fast-forwarding (issue 4, mechanism 2; the whole network is one partition).
//!
//! Every `accel.sample_interval` of simulated time the engine records, for each active flow
//! (released, not finished), the payload bytes it delivered in order since the previous
//! sample. A flow is steady when its last `window` samples — all taken after the most
//! recent flow release or completion anywhere, so a change of the contention pattern is
//! always followed by a full window of fresh observation — have `(max - min) / mean <
//! theta` and a positive mean, it is not retransmitting (go-back-N in progress) or dead,
//! and, with DCQCN:
//! - its sending rate (the DCQCN rate, sampled alongside) moved by at most `rate_theta`
//!   over the window: at a shared bottleneck the delivered rate is flat while CNPs still
//!   walk the sending rate down as the queue builds, and a jump would freeze that drift;
//! - it is not *recovering*: a queue pair that saw no rate decrease within the window but
//!   whose rate-increase timer is running with a target more than `rate_theta` above its
//!   rate will change its rate by more than that at the next increase, so it is not steady
//!   however flat its samples look.
//!
//! When every active flow is steady the network *jumps* by `J`, the smallest of: the time to
//! the next pending flow release; for each flow, the time its sender needs at its mean
//! delivered rate to reach its last packet, minus `tail_margin`. Jumps under `min_jump` are
//! not taken. A jump of `J`:
//! - moves each flow forward by `k = rate * J / mtu` whole packets (the fraction is carried
//!   to the next jump): sender and receiver sequence numbers, every in-flight or queued
//!   packet of the flow (data and ACK/NACK sequence numbers), delivered and sent bytes, the
//!   payload bytes of every link on its path, and its ACK count;
//! - leaves everything else as it is: queue occupancy, PFC state, DCQCN state, timers and
//!   in-flight packets' positions. Time is an offset: the engine's clock and every pending
//!   event stay where they are and the *global* clock (what the report shows) is the local
//!   one plus the total jumped time, so a jump costs O(live packets + active flows +
//!   pending releases), not a rewrite of the event queue. Pending releases, whose global
//!   times are fixed, are moved back by `J` with `HeapQueue::reschedule` (one heap push
//!   each).
//!
//! Releases are the only events that come from outside the network, and all of them are
//! known when the jump is planned (a release is scheduled when its last dependency
//! finishes, and no flow finishes inside a jump), so with one partition no unannounced
//! event can reach it during a jump and no rollback is needed. Per-partition jumps
//! (partitioning) would need one: a flow released into a partition that has jumped past the
//! release time must roll the partition back to a snapshot taken at the jump.

use super::engine::{Engine, Ev, Kind};
use orrery_des::EventQueue;
use orrery_units::Picos;

const NONE: u32 = u32::MAX;

/// Fast-forwarding state: per-flow rings of delivered-bytes samples and the active set.
#[derive(Debug)]
pub(crate) struct FastForward {
    window: usize,
    /// `window` samples per flow; sample `n` of every flow is in slot `n % window`.
    ring: Vec<u64>,
    /// The sending rate (DCQCN rate) at each sample, same layout.
    rate_ring: Vec<f64>,
    last_delivered: Vec<u64>,
    /// Rate decreases seen at the last sample, and the sample number when that changed.
    last_dec: Vec<u64>,
    last_dec_sample: Vec<u64>,
    /// Fractional packets carried from one jump to the next.
    frac: Vec<f64>,
    /// Packets each flow moves in the jump being applied (zero otherwise).
    shift: Vec<u64>,
    active: Vec<u32>,
    active_pos: Vec<u32>,
    /// Samples taken, and samples since the last release or completion.
    samples: u64,
    since_change: u64,
    /// A sample event is pending.
    pending: bool,
}

impl FastForward {
    pub fn new(flows: usize, window: usize) -> FastForward {
        FastForward {
            window,
            ring: vec![0; flows * window],
            rate_ring: vec![0.0; flows * window],
            last_delivered: vec![0; flows],
            last_dec: vec![0; flows],
            last_dec_sample: vec![0; flows],
            frac: vec![0.0; flows],
            shift: vec![0; flows],
            active: Vec::new(),
            active_pos: vec![NONE; flows],
            samples: 0,
            since_change: 0,
            pending: false,
        }
    }
}

impl Engine<'_> {
    /// Pending fast-forward sample events (0 or 1).
    pub(super) fn ff_pending(&self) -> usize {
        self.ff.as_ref().map_or(0, |ff| usize::from(ff.pending))
    }

    /// Flow `f` was released (and has packets): it joins the sampled set.
    pub(super) fn ff_on_release(&mut self, f: u32) {
        let now = self.now;
        let interval = self.cfg.accel.sample_interval;
        let delivered = self.flows[f as usize].delivered;
        let decreases = self.flows[f as usize].rp.decreases;
        let Some(ff) = self.ff.as_mut() else {
            return;
        };
        let i = f as usize;
        if ff.active_pos[i] == NONE {
            ff.active_pos[i] = ff.active.len() as u32;
            ff.active.push(f);
        }
        ff.last_delivered[i] = delivered;
        ff.last_dec[i] = decreases;
        ff.last_dec_sample[i] = ff.samples;
        ff.since_change = 0;
        if !ff.pending {
            ff.pending = true;
            self.q
                .schedule(Picos(now.0.saturating_add(interval.0)), Ev::FfSample);
        }
    }

    /// Flow `f` finished: it leaves the sampled set.
    pub(super) fn ff_on_finish(&mut self, f: u32) {
        let Some(ff) = self.ff.as_mut() else {
            return;
        };
        ff.since_change = 0;
        let pos = ff.active_pos[f as usize];
        if pos == NONE {
            return;
        }
        ff.active_pos[f as usize] = NONE;
        ff.active.swap_remove(pos as usize);
        if let Some(&moved) = ff.active.get(pos as usize) {
            ff.active_pos[moved as usize] = pos;
        }
    }

    /// The fast-forward sample: record every active flow's delivered bytes, jump if all are
    /// steady, and schedule the next sample while anything can still happen.
    pub(super) fn ff_sample(&mut self) {
        let Some(mut ff) = self.ff.take() else {
            return;
        };
        ff.pending = false;
        if !ff.active.is_empty() {
            let w = ff.window;
            let slot = (ff.samples % w as u64) as usize;
            for &f in &ff.active {
                let i = f as usize;
                let fl = &self.flows[i];
                ff.ring[i * w + slot] = fl.delivered - ff.last_delivered[i];
                ff.rate_ring[i * w + slot] = fl.rp.rate;
                ff.last_delivered[i] = fl.delivered;
                if fl.rp.decreases != ff.last_dec[i] {
                    ff.last_dec[i] = fl.rp.decreases;
                    ff.last_dec_sample[i] = ff.samples;
                }
            }
            ff.samples += 1;
            ff.since_change += 1;
            if ff.since_change > w as u64 {
                self.try_jump(&mut ff);
            }
            // Other events besides this one and a trace sample: the run is not over.
            if self.unfinished > 0 && self.q.len() > self.trace_pending() {
                ff.pending = true;
                let at = Picos(self.now.0.saturating_add(self.cfg.accel.sample_interval.0));
                self.q.schedule(at, Ev::FfSample);
            }
        }
        self.ff = Some(ff);
    }

    /// Jumps ahead if every active flow is steady (see the module essay).
    fn try_jump(&mut self, ff: &mut FastForward) {
        let cfg = self.cfg;
        let a = &cfg.accel;
        let now = self.now;
        let w = ff.window;
        let mtu = u64::from(cfg.mtu_payload);
        let interval = a.sample_interval.as_secs_f64();
        let mut limit = u64::MAX;
        for &(t, _) in self.pending_rel.iter().flatten() {
            limit = limit.min(t.0.saturating_sub(now.0));
        }
        let mut rates = Vec::with_capacity(ff.active.len());
        for &f in &ff.active {
            let i = f as usize;
            let fl = &self.flows[i];
            if fl.dead || fl.snd_nxt < fl.high || fl.snd_nxt >= fl.npkts {
                return;
            }
            let s = &ff.ring[i * w..(i + 1) * w];
            let (mut lo, mut hi, mut sum) = (u64::MAX, 0u64, 0u64);
            for &x in s {
                lo = lo.min(x);
                hi = hi.max(x);
                sum += x;
            }
            let mean = sum as f64 / w as f64;
            if mean <= 0.0 || (hi - lo) as f64 >= a.theta * mean {
                return;
            }
            if cfg.dcqcn {
                let r = &ff.rate_ring[i * w..(i + 1) * w];
                let lo = r.iter().copied().fold(f64::INFINITY, f64::min);
                let hi = r.iter().copied().fold(0.0, f64::max);
                if hi - lo > a.rate_theta * hi {
                    return;
                }
            }
            if cfg.dcqcn
                && ff.samples - ff.last_dec_sample[i] > w as u64
                && fl.rp.next_increase().is_some()
                && fl.rp.target - fl.rp.rate > a.rate_theta * fl.rp.rate
            {
                return;
            }
            let rate = mean / interval; // bytes per second
                                        // Full packets the sender has left before its last one.
            let left = (fl.npkts - 1 - fl.snd_nxt) * mtu;
            let t_left = Picos::from_secs_f64(left as f64 / rate);
            limit = limit.min(t_left.0.saturating_sub(a.tail_margin.0));
            rates.push(rate);
        }
        if limit < a.min_jump.0 || limit == u64::MAX {
            return;
        }
        let jump = Picos(limit);
        let secs = jump.as_secs_f64();
        let ack_every = u64::from(cfg.ack_every);
        let mut moved = 0u64;
        for (&f, &rate) in ff.active.iter().zip(&rates) {
            let i = f as usize;
            let x = rate * secs / mtu as f64 + ff.frac[i];
            let whole = x.floor();
            ff.frac[i] = x - whole;
            let fl = &mut self.flows[i];
            let k = (whole as u64).min(fl.npkts - 1 - fl.snd_nxt);
            if k == 0 {
                continue;
            }
            ff.shift[i] = k;
            moved += k;
            let bytes = k * mtu;
            let acks = (fl.rcv_nxt + k) / ack_every - fl.rcv_nxt / ack_every;
            fl.snd_nxt += k;
            fl.snd_una += k;
            fl.high += k;
            fl.rcv_nxt += k;
            if fl.nack_trigger != u64::MAX {
                fl.nack_trigger += k;
            }
            fl.delivered += bytes;
            ff.last_delivered[i] += bytes;
            self.bytes_sent += bytes;
            self.bytes_delivered += bytes;
            self.stats.acks += acks;
            let (start, len) = fl.fwd;
            for h in start..start + len {
                self.link_bytes[self.paths[h as usize] as usize] += bytes;
            }
        }
        if moved > 0 {
            // Every packet of a moved flow, wherever it is, carries the moved numbering.
            let mut free = vec![false; self.pkts.len()];
            for &p in self.free_slots() {
                free[p as usize] = true;
            }
            for (pk, _) in self.pkts.iter_mut().zip(&free).filter(|(_, &f)| !f) {
                let k = ff.shift[pk.flow as usize];
                if k > 0 && pk.kind != Kind::Cnp {
                    pk.seq += k;
                }
            }
            for &f in &ff.active {
                ff.shift[f as usize] = 0;
            }
        }
        // The jump: global time moves, local time and pending events stay; releases keep
        // their global times.
        self.offset = Picos(self.offset.0 + jump.0);
        for slot in self.pending_rel.iter_mut() {
            if let Some((t, key)) = *slot {
                let at = Picos(t.0 - jump.0);
                *slot = self.q.reschedule(key, at).map(|k| (at, k));
            }
        }
        let st = &mut self.stats;
        st.fast_forwards += 1;
        st.jumped_time = Picos(st.jumped_time.0 + jump.0);
        st.skipped_packets += moved;
        st.skipped_bytes += moved * mtu;
        if self.data_packets > 0 {
            let per_packet = self.events as f64 / self.data_packets as f64;
            st.skipped_events += (moved as f64 * per_packet).round() as u64;
        }
    }
}
