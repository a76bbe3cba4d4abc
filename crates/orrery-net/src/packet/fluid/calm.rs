//! Calm flows frozen and thawed: the calm skip of the fluid model (see "Calm flows" in
//! the parent module's essay). A calm flow is taken out of the steps with its load kept on
//! its links ([`Fluid::try_freeze`]) and put back with the grants it missed added one by
//! one ([`Fluid::thaw`]) when its time comes or when something reaches one of its links
//! ([`Fluid::thaw_where_reached`]). Everything here keeps the bits stepping every flow
//! gives: the loads it moves are on the grid, and the tests it decides by are the ones a
//! step would run.

use super::{on_grid, slot_bit, Fluid, Part, DUST, MIN_FREEZE_STEPS};
use orrery_units::Picos;

impl Fluid<'_> {
    /// Takes off (at a freeze, the end of step `k`) or puts back (`thawing`: before step
    /// `k` transmits) the ACKs a frozen flow `f`'s grants of `ack` wire bytes have on their
    /// way to the links of its reverse path after the receiver's: at a freeze, those of
    /// grants delivered up to `k` due after it; at a thaw, those of grants delivered before
    /// `k` due from it (a grant delivered at `k` is delivered by the thaw). They come one
    /// per transmission, at the flow's stride; the one due at the link's next step is in
    /// `ctrl` already.
    fn frozen_acks(&mut self, f: u32, k: u64, ack: f64, thawing: bool) {
        let (a, n) = self.flows[f as usize].rev;
        let stride = self.flows[f as usize].stride as usize;
        let k = k as usize;
        let delta = if thawing { ack } else { -ack };
        let mut after = 0usize;
        for h in a..a + n {
            let l = self.paths[h as usize];
            let link = &mut self.links[l as usize];
            if after > 0 {
                // Due at `m + after` for deliveries at transmissions `m`.
                let (first, last, in_ctrl) = if thawing {
                    (k.next_multiple_of(stride), k + after - 1, k)
                } else {
                    (k + stride, k + after, k + 1)
                };
                // A freeze waits until each of these holds one grant's ACKs of the flow
                // (`try_freeze`), so taking them off leaves no slot below zero: the sums
                // are on the grid, exact.
                for due in (first..=last).step_by(stride) {
                    if due == in_ctrl {
                        debug_assert!(link.ctrl + delta >= 0.0, "{} {delta}", link.ctrl);
                        link.ctrl = (link.ctrl + delta).max(0.0);
                    } else {
                        let slot = due & (link.ctrl_ring.len() - 1);
                        debug_assert!(link.ctrl_ring[slot] + delta >= 0.0);
                        link.ctrl_ring[slot] = (link.ctrl_ring[slot] + delta).max(0.0);
                        link.ctrl_ahead = (link.ctrl_ahead + delta).max(0.0);
                    }
                }
            }
            after += link.delay_steps;
        }
    }

    /// Freezes flow `f` at the end of step `k` if it is calm: its port granted it the same
    /// whole step (at its rate, or all the room of a port it has to itself) for as long
    /// as its path takes to carry it, every link of
    /// its path holds one such grant per step in flight and nothing queued, paused or
    /// about to pause, its receiver took one grant in step `k`, and no rate change is due
    /// but a rate increase (it thaws by then). Its bytes in flight leave the rings; its
    /// links keep its load per step (`frozen`, `frozen_ctrl`) to count it when others use
    /// them; it thaws at the latest two grants before its bytes run out.
    pub(super) fn try_freeze(&mut self, f: u32, k: u64) {
        let fl = &self.flows[f as usize];
        let stride = fl.stride;
        debug_assert!(stride != 0, "a flow across strides is never a candidate");
        debug_assert!(k.is_multiple_of(stride), "grants come at transmissions");
        let x = fl.last_give;
        // The ACKs a grant sends back, and those of the deliveries still in flight: each
        // one grant's, or taking them off the rings as such (`frozen_acks`) leaves a
        // remainder there (a flow frozen a transmission after its deliveries changed put
        // a byte of ACKs too many on a congested link of the ECMP GPT 350M step at 1,024
        // GPUs, and a flow sharing it finished 21 ps off stepping every flow).
        let ack = on_grid(x * self.ack_per_wire);
        let acks_ok = fl.acked_in_step == ack
            && (fl.acks_in_flight == 0
                || (fl.ack_run_end + stride == k
                    && fl.ack_run_total == ack
                    && fl.ack_run >= fl.acks_in_flight));
        if fl.frozen.is_some()
            || fl.finish.is_some()
            || fl.rp.pending_decrease().is_some()
            || !fl.cnps.is_empty()
            || fl.delivered_step != k
            || (fl.delivered_in_step - x).abs() > 1e-9 * x
            || !acks_ok
        {
            self.flows[f as usize].same_gives = 0;
            return;
        }
        let runs = ((fl.wire_total - fl.wire_sent) / x).floor() as u64;
        let mut until = k + runs.saturating_sub(1) * stride;
        if let Some(at) = fl.rp.next_increase() {
            until = until.min(at.0.div_ceil(self.dt));
        }
        // Held under its rate, it must have had its port to itself, all of its room.
        let held = x < self.nic_demand(f, Picos(k * self.dt)).2;
        let port = &self.links[self.path(f)[0] as usize];
        let port_ok =
            !port.frozen_held && (!held || (port.qps.len() == 1 && port.frozen_flows.is_empty()));
        if until < k + MIN_FREEZE_STEPS * stride || !port_ok || !self.calm_path(f, k, x) {
            self.flows[f as usize].same_gives = 0;
            return;
        }
        let (a, n) = self.flows[f as usize].fwd;
        for h in 0..n {
            let l = self.paths[(a + h) as usize] as usize;
            let link = &mut self.links[l];
            // One grant in flight per transmission of its delay.
            for j in (stride as usize..=link.delay_steps).step_by(stride as usize) {
                let slot = (k as usize + j) & (link.ring.len() - 1);
                link.ring[slot].retain(|p| p.flow != f || p.hop != h);
            }
            let grants = link.delay_steps / stride as usize;
            link.in_flight -= grants;
            self.in_flight_total -= grants;
            link.frozen_flows.push(f);
            if !link.in_frozen_links {
                link.in_frozen_links = true;
                self.frozen_links.push(l as u32);
            }
            if h == 0 {
                link.qps.retain(|&q| q != f);
                link.frozen_held = held;
                self.senders -= 1;
            }
        }
        self.flows[f as usize].frozen = Some((k, until));
        self.sum_frozen(f);
        let (a, n) = self.flows[f as usize].rev;
        for h in a..a + n {
            self.links[self.paths[h as usize] as usize].frozen_ctrl += ack;
        }
        self.frozen_acks(f, k, ack, false);
        self.thaws.insert((until, f));
        self.freezes += 1;
    }

    /// Adds up again what the flows frozen on flow `f`'s links send on each per step (after
    /// `f` froze or thawed): a sum of the few flows there, rather than a running sum that
    /// would keep the rounding of every flow that came and went.
    fn sum_frozen(&mut self, f: u32) {
        let (a, n) = self.flows[f as usize].fwd;
        for &l in &self.paths[a as usize..(a + n) as usize] {
            let link = &mut self.links[l as usize];
            link.frozen = link
                .frozen_flows
                .iter()
                .map(|&q| self.flows[q as usize].last_give)
                .sum();
        }
    }

    /// Whether every link of flow `f`'s path is calm for it at the end of step `k`: one
    /// part of `x` wire bytes of it in flight per transmission in the link's delay (per
    /// step unless strided), as a whole transmission sends it (from its start to its
    /// end), no queue, no pause sent, due or held.
    fn calm_path(&self, f: u32, k: u64, x: f64) -> bool {
        let quiet = self.path(f).iter().all(|&l| {
            let link = &self.links[l as usize];
            !(link.paused
                || link.pause_sent
                || link.pause_changes > 0
                || (link.from_switch && link.queued > DUST))
        });
        // In each slot the link's delay fills (one per transmission), one part of `f`: a
        // whole transmission's grant of `x`.
        let stride = self.flows[f as usize].stride as usize;
        let whole = stride as f64;
        let one_grant = |slot: &[Part], h: usize| {
            let mut mine = slot.iter().filter(|p| p.flow == f && p.hop as usize == h);
            match (mine.next(), mine.next()) {
                (Some(p), None) => {
                    (p.wire - x).abs() <= 1e-9 * x && p.begin == 0.0 && p.end == whole
                }
                _ => false,
            }
        };
        quiet
            && self.path(f).iter().enumerate().all(|(h, &l)| {
                let link = &self.links[l as usize];
                (stride..=link.delay_steps)
                    .step_by(stride)
                    .all(|j| one_grant(&link.ring[(k as usize + j) & (link.ring.len() - 1)], h))
            })
    }

    /// Thaws, before step `k` transmits, the frozen flows due to thaw by `k` and every
    /// frozen flow on a link that is no longer calm: paused, holding bytes from an earlier
    /// step, or asked for more than its room with the frozen flows' share counted. Such a
    /// link would have queued or shared out the frozen flows' bytes too, so they must be
    /// there. Thawing moves load from `frozen` into the queues and rings of the same
    /// links, so it makes no other link less calm; links it lists are checked in turn.
    pub(super) fn thaw_where_reached(&mut self, k: u64) {
        while let Some(&(at, f)) = self.thaws.first() {
            if at > k {
                break;
            }
            self.thaw(f, k);
        }
        let t = Picos(k * self.dt);
        let links = &mut self.links;
        self.frozen_links.retain(|&l| {
            let link = &mut links[l as usize];
            link.in_frozen_links = !link.frozen_flows.is_empty();
            link.in_frozen_links
        });
        // In any order: a thaw moves a flow's load from `frozen` into the queues and rings
        // of its links, which leaves every other link's test as it was.
        for i in 0..self.frozen_links.len() {
            let l = self.frozen_links[i] as usize;
            if self.reached(l, k, t) {
                self.forced_thaws += self.links[l].frozen_flows.len() as u64;
                while let Some(&f) = self.links[l].frozen_flows.last() {
                    self.thaw(f, k);
                }
            }
        }
    }

    /// Whether something reached frozen flows' link `l` by step `k` (at `t`), which they
    /// must thaw for (see [`Fluid::thaw_where_reached`]); false where none is frozen.
    pub(super) fn reached(&self, l: usize, k: u64, t: Picos) -> bool {
        let link = &self.links[l];
        if link.frozen_flows.is_empty() {
            return false;
        }
        let (room, _) = self.room(l as u32);
        link.paused
            || if link.from_switch {
                // As `serve_fifo` decides whether a segment goes whole.
                link.segs.front().is_some_and(|s| s.2 < k)
                    || link.queued + link.frozen > room + DUST
            } else if link.frozen_held {
                // Its flow took all the room: any other sender, or any other room, and
                // the port would have granted it something else.
                !link.qps.is_empty() || room != link.frozen
            } else {
                let asked: f64 = link.qps.iter().map(|&q| self.nic_demand(q, t).0).sum();
                asked + link.frozen > room
            }
    }

    /// Puts frozen flow `f` back into step `k` (after its landings, before it transmits):
    /// it sent and delivered one grant at each of its transmissions while frozen, its grant
    /// that lands in step `k` on each link (if `k` is a transmission) joins the next link's
    /// FIFO (or reaches its receiver), the rest of its grants in flight go back on the
    /// rings, its rate is brought to the step's start, and its port serves it again.
    fn thaw(&mut self, f: u32, k: u64) {
        let t = Picos(k * self.dt);
        let Some((at, until)) = self.flows[f as usize].frozen.take() else {
            return;
        };
        self.thaws.remove(&(until, f));
        let x = self.flows[f as usize].last_give;
        let fl = &mut self.flows[f as usize];
        let stride = fl.stride;
        // One grant per transmission after `at` and before `k` (`at` is one), added as the
        // steps would have added them (a product would round differently, and the
        // completion is interpolated on these sums). Every link of its path transmits and
        // lands at the same steps, so its receiver took as many.
        for _ in 0..(k - 1) / stride - at / stride {
            fl.wire_sent += x;
            fl.wire_delivered += x;
        }
        fl.same_gives = 0;
        let part = |hop: u32| Part {
            flow: f,
            hop,
            wire: x,
            begin: 0.0,
            end: stride as f64,
        };
        let lands_now = k.is_multiple_of(stride);
        let (a, n) = self.flows[f as usize].fwd;
        for h in 0..n {
            let l = self.paths[(a + h) as usize];
            let link = &mut self.links[l as usize];
            link.frozen_flows.retain(|&q| q != f);
            // Its grants sent before step `k` that land after it, at transmissions.
            let mut grants = 0;
            let (first, end) = (
                (k + 1).next_multiple_of(stride),
                k + link.delay_steps as u64,
            );
            for at in (first..end).step_by(stride as usize) {
                let slot = at as usize & (link.ring.len() - 1);
                link.ring_bits |= slot_bit(slot);
                link.ring[slot].push(part(h));
                grants += 1;
            }
            link.in_flight += grants;
            self.in_flight_total += grants;
            if h == 0 {
                link.qps.push(f);
                link.frozen_held = false;
                self.senders += 1;
            }
            self.list(l);
            if !lands_now {
                continue;
            }
            if h + 1 == n {
                self.deliver(&part(h), k);
            } else {
                let out = self.paths[(a + h + 1) as usize];
                let next = &mut self.links[out as usize];
                // Into this step's segment, in its place by flow.
                let fresh = match next.segs.back_mut() {
                    Some(seg) if seg.2 == k => {
                        seg.0 += 1;
                        seg.1 += x;
                        seg.0 as usize - 1
                    }
                    _ => {
                        next.segs.push_back((1, x, k));
                        0
                    }
                };
                let start = next.parts.len() - fresh;
                let at = (start..next.parts.len())
                    .find(|&i| next.parts[i].flow > f)
                    .unwrap_or(next.parts.len());
                next.parts.insert(at, part(h + 1));
                next.queued += x;
                self.list(out);
                self.ingress_add(l, on_grid(x * self.buffered_per_wire));
            }
        }
        self.sum_frozen(f);
        // On the grid, so the frozen ACKs come off exactly (to zero with the last).
        let ack = on_grid(x * self.ack_per_wire);
        let (a, n) = self.flows[f as usize].rev;
        for h in a..a + n {
            let l = self.paths[h as usize];
            self.links[l as usize].frozen_ctrl -= ack;
            self.list(l);
        }
        self.frozen_acks(f, k, ack, true);
        if self.cfg.dcqcn {
            self.drive_rate(f, t);
        }
    }
}
