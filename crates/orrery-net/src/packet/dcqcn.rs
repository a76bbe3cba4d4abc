//! The DCQCN reaction point: one queue pair's sending rate, as a small state machine.
//!
//! It follows the Mellanox/NVIDIA ConnectX behaviour as the ns-3 RDMA simulators model it
//! (`mlx` DCQCN):
//!
//! - **First CNP.** Alpha is set to `initial_alpha` (1.0), the target rate to the current
//!   rate; the alpha-update clock (period `alpha_update_interval`) and the rate-decrease
//!   clock (period `rate_decrease_interval`, offset by 1 ps so it ticks just after an alpha
//!   update of the same instant) start at the CNP's arrival.
//! - **Every CNP** flags the current alpha period and the current decrease period.
//! - **Alpha update** (each alpha tick): `alpha = (1 - g) * alpha + g` if a CNP arrived in
//!   the period, else `alpha = (1 - g) * alpha`.
//! - **Decrease** (each decrease tick with a CNP since the last one): the target becomes the
//!   current rate if `clamp_target_rate` or the QP was in an increase stage, then
//!   `rate = max(min_rate, rate * (1 - alpha / 2))`; the increase stage resets to 0 and the
//!   rate-increase timer restarts.
//! - **Increase** (each `rate_increase_timer` period without a decrease): stage `< F`: fast
//!   recovery, `rate = (rate + target) / 2`; stage `== F`: additive increase, `target +=
//!   AI` (capped at line rate) then `rate = (rate + target) / 2`; stage `> F`: hyper
//!   increase, the same with `HAI`. The stage then counts up.
//!
//! The clocks are *lazy*: alpha is brought up to date (`(1 - g)^n` for `n` quiet ticks)
//! whenever it is read, and the decrease tick is scheduled only when a CNP is pending, so a
//! queue pair costs no events while nothing happens to it. The results are the periodic
//! clocks' results (up to floating-point rounding of `powi`); the byte counter of the
//! original DCQCN is not modelled (rate increases are timer-driven only).

use super::config::DcqcnParams;
use orrery_units::Picos;

/// One queue pair's DCQCN state. Rates are bytes per second.
#[derive(Debug, Clone, PartialEq)]
pub struct ReactionPoint {
    /// Current sending rate `Rc`.
    pub rate: f64,
    /// Target rate `Rt`.
    pub target: f64,
    /// The NIC's line rate (the cap of every increase).
    pub line: f64,
    /// Congestion estimate, as of `alpha_tick`.
    pub alpha: f64,
    alpha_tick: Picos,
    alpha_flag: bool,
    decrease_flag: bool,
    /// Increase events since the last decrease.
    pub stage: u32,
    cnp_seen: bool,
    decrease_anchor: Picos,
    decrease_pending: bool,
    /// When the pending decrease tick fires (meaningful while `decrease_pending`).
    decrease_at: Picos,
    increase_deadline: Picos,
    increase_pending: bool,
    /// Rate decreases applied (for statistics).
    pub decreases: u64,
}

impl ReactionPoint {
    /// A queue pair that starts at line rate.
    pub fn new(line: f64) -> ReactionPoint {
        ReactionPoint {
            rate: line,
            target: line,
            line,
            alpha: 1.0,
            alpha_tick: Picos::ZERO,
            alpha_flag: false,
            decrease_flag: false,
            stage: 0,
            cnp_seen: false,
            decrease_anchor: Picos::ZERO,
            decrease_pending: false,
            decrease_at: Picos::ZERO,
            increase_deadline: Picos::ZERO,
            increase_pending: false,
            decreases: 0,
        }
    }

    /// When the rate-increase timer will next raise the rate, if it is running (the
    /// fast-forward stops there for a queue pair that is recovering without CNPs).
    pub fn next_increase(&self) -> Option<Picos> {
        self.increase_pending.then_some(self.increase_deadline)
    }

    /// When the pending decrease tick fires, if a CNP is waiting for one.
    pub fn pending_decrease(&self) -> Option<Picos> {
        self.decrease_pending.then_some(self.decrease_at)
    }

    /// No rate cut is waiting for its decrease period: without a CNP the rate changes next
    /// when the rate-increase timer fires ([`ReactionPoint::next_increase`]), or never if
    /// it is not running (at line rate).
    pub fn rate_held(&self) -> bool {
        !self.decrease_pending
    }

    /// Moves every time this state keeps `d` later (a partition's fast-forward jump
    /// postpones all its pending events by `d`).
    pub fn shift(&mut self, d: Picos) {
        self.alpha_tick = Picos(self.alpha_tick.0 + d.0);
        self.decrease_anchor = Picos(self.decrease_anchor.0 + d.0);
        self.decrease_at = Picos(self.decrease_at.0.saturating_add(d.0));
        self.increase_deadline = Picos(self.increase_deadline.0.saturating_add(d.0));
    }

    /// Applies the alpha ticks up to and including `now`.
    fn catch_up_alpha(&mut self, now: Picos, p: &DcqcnParams) {
        if !self.cnp_seen || now <= self.alpha_tick {
            return;
        }
        let period = p.alpha_update_interval.0.max(1);
        let n = (now.0 - self.alpha_tick.0) / period;
        if n == 0 {
            return;
        }
        let keep = 1.0 - p.g;
        self.alpha = if self.alpha_flag {
            keep * self.alpha + p.g
        } else {
            keep * self.alpha
        };
        if n > 1 {
            let quiet = i32::try_from(n - 1).unwrap_or(i32::MAX);
            self.alpha *= keep.powi(quiet);
        }
        self.alpha_flag = false;
        self.alpha_tick = Picos(self.alpha_tick.0 + n * period);
    }

    /// The alpha value at `now` (applies pending ticks).
    pub fn alpha_at(&mut self, now: Picos, p: &DcqcnParams) -> f64 {
        self.catch_up_alpha(now, p);
        self.alpha
    }

    /// A CNP arrived at `now`. Returns the time of the decrease tick to schedule, if one is
    /// not already scheduled.
    pub fn on_cnp(&mut self, now: Picos, p: &DcqcnParams) -> Option<Picos> {
        self.catch_up_alpha(now, p);
        if self.cnp_seen {
            self.alpha_flag = true;
        } else {
            self.cnp_seen = true;
            self.alpha = p.initial_alpha;
            self.alpha_tick = now;
            self.alpha_flag = false;
            self.decrease_anchor = Picos(now.0 + 1);
            self.target = self.rate;
        }
        self.decrease_flag = true;
        if self.decrease_pending {
            return None;
        }
        self.decrease_pending = true;
        let period = p.rate_decrease_interval.0.max(1);
        let a = self.decrease_anchor.0;
        let next = if now.0 < a + period {
            a + period
        } else {
            a + ((now.0 - a) / period + 1) * period
        };
        self.decrease_at = Picos(next);
        Some(Picos(next))
    }

    /// The decrease tick fired. Returns the time of the rate-increase timer to schedule, if
    /// one is not already scheduled.
    pub fn on_decrease_tick(&mut self, now: Picos, p: &DcqcnParams) -> Option<Picos> {
        self.decrease_pending = false;
        if !self.decrease_flag {
            return None;
        }
        self.catch_up_alpha(now, p);
        if p.clamp_target_rate || self.stage != 0 {
            self.target = self.rate;
        }
        self.rate = (self.rate * (1.0 - self.alpha / 2.0)).max(p.min_rate.0.min(self.line));
        self.stage = 0;
        self.decrease_flag = false;
        self.decreases += 1;
        self.increase_deadline = Picos(now.0.saturating_add(p.rate_increase_timer.0));
        if self.increase_pending {
            return None;
        }
        self.increase_pending = true;
        Some(self.increase_deadline)
    }

    /// Drives the queue pair from its present state through CNPs arriving at the times
    /// `cnps` yields (increasing, none before the last event applied), applying each
    /// decrease tick they schedule, in time order, as the engine's own events would (a
    /// tick and a CNP at the same time: the tick first, scheduled earlier), up to but not
    /// including `until`. Stops at the first decrease that leaves the rate below `floor`,
    /// or where its rate-increase timer would fire, and returns that time (`None`: it
    /// reached `until`). How a fast-forward jump carries a flow through a stretch in which
    /// its packets are marked often enough for a CNP every interval (see the `accel`
    /// module: such a flow's rate only falls, a CNP's cut at a time, and the timer never
    /// fires while cuts keep coming).
    pub fn drive(
        &mut self,
        cnps: &mut dyn Iterator<Item = Picos>,
        until: Picos,
        floor: f64,
        p: &DcqcnParams,
    ) -> Option<Picos> {
        let mut next_cnp = cnps.next();
        loop {
            let tick = self.decrease_pending.then_some(self.decrease_at);
            let timer = self.increase_pending.then_some(self.increase_deadline);
            let t = [tick, timer, next_cnp].into_iter().flatten().min()?;
            if t >= until {
                return None;
            }
            if Some(t) == tick {
                let _ = self.on_decrease_tick(t, p);
                if self.rate < floor {
                    return Some(t);
                }
            } else if Some(t) == timer {
                return Some(t);
            } else {
                let _ = self.on_cnp(t, p);
                next_cnp = cnps.next();
            }
        }
    }

    /// The rate-increase timer fired. Returns when to fire it next, if at all (it stops
    /// once rate and target are both at line rate; the next decrease restarts it).
    pub fn on_increase_timer(&mut self, now: Picos, p: &DcqcnParams) -> Option<Picos> {
        self.increase_pending = false;
        if now < self.increase_deadline {
            // Restarted by a decrease since this firing was scheduled.
            self.increase_pending = true;
            return Some(self.increase_deadline);
        }
        let f = p.fast_recovery_stages;
        if self.stage > f {
            self.target = (self.target + p.hyper_increase.0).min(self.line);
        } else if self.stage == f {
            self.target = (self.target + p.additive_increase.0).min(self.line);
        }
        self.rate = (self.rate / 2.0 + self.target / 2.0).min(self.line);
        self.stage = self.stage.saturating_add(1);
        if self.rate >= self.line && self.target >= self.line {
            return None;
        }
        self.increase_deadline = Picos(now.0.saturating_add(p.rate_increase_timer.0));
        self.increase_pending = true;
        Some(self.increase_deadline)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LINE: f64 = 12.5e9; // 100 Gb/s

    #[test]
    fn a_queue_pair_holds_its_rate_except_while_a_cut_is_pending() {
        let p = DcqcnParams::default();
        let mut rp = ReactionPoint::new(LINE);
        assert!(rp.rate_held() && rp.next_increase().is_none());
        // A CNP schedules a cut: pending, so the rate is not held, before it moves.
        let dec = rp.on_cnp(Picos::from_micros(10), &p).unwrap();
        assert_eq!(rp.rate, LINE);
        assert!(!rp.rate_held());
        // Cut: held again, until the increase timer it started.
        let mut next = rp.on_decrease_tick(dec, &p);
        assert!(rp.rate < LINE && rp.rate_held());
        assert_eq!(rp.next_increase(), next);
        // Recovery by the increase timer alone, no further CNP, back to line rate, the
        // rate held between increases.
        let mut fired = 0;
        while let Some(t) = next {
            assert!(rp.rate_held() && rp.rate < LINE);
            next = rp.on_increase_timer(t, &p);
            fired += 1;
            assert!(fired < 10_000, "never recovered");
        }
        assert_eq!((rp.rate, rp.target), (LINE, LINE));
        assert!(rp.rate_held() && rp.next_increase().is_none());
    }

    #[test]
    fn first_cnp_cuts_the_rate_by_about_half_after_one_decrease_period() {
        let p = DcqcnParams::default();
        let mut rp = ReactionPoint::new(LINE);
        let t0 = Picos::from_micros(10);
        let dec = rp.on_cnp(t0, &p).unwrap();
        assert_eq!(dec, Picos(t0.0 + 1 + 4_000_000));
        let inc = rp.on_decrease_tick(dec, &p).unwrap();
        // Four quiet alpha ticks: alpha = (255/256)^4.
        let alpha = (1.0 - 1.0 / 256.0f64).powi(4);
        assert!((rp.rate - LINE * (1.0 - alpha / 2.0)).abs() < 1.0);
        assert_eq!(rp.target, LINE);
        assert_eq!(inc, Picos(dec.0 + 900_000_000));
        // No further CNP: fast recovery halves the gap, then additive increase.
        let r1 = rp.rate;
        let next = rp.on_increase_timer(inc, &p).unwrap();
        assert!((rp.rate - (r1 + LINE) / 2.0).abs() < 1.0);
        assert_eq!(rp.stage, 1);
        let _ = rp.on_increase_timer(next, &p);
        assert_eq!(rp.stage, 2);
        assert_eq!(rp.target, LINE); // capped at line rate
    }

    #[test]
    fn alpha_rises_with_cnps_and_decays_without() {
        let p = DcqcnParams::default();
        let mut rp = ReactionPoint::new(LINE);
        let _ = rp.on_cnp(Picos::ZERO, &p);
        let a0 = rp.alpha_at(Picos::ZERO, &p);
        assert_eq!(a0, 1.0);
        // 256 quiet ticks: alpha ~ e^-1.
        let a = rp.alpha_at(Picos::from_micros(256), &p);
        assert!((a - (255.0f64 / 256.0).powi(256)).abs() < 1e-12);
        // A CNP mid-period raises the next tick.
        let t = Picos(Picos::from_micros(256).0 + 500_000);
        let _ = rp.on_cnp(t, &p);
        let b = rp.alpha_at(Picos::from_micros(257), &p);
        assert!((b - ((255.0 / 256.0) * a + 1.0 / 256.0)).abs() < 1e-12);
    }

    #[test]
    fn decrease_ticks_are_on_the_grid_and_coalesce() {
        let p = DcqcnParams::default();
        let mut rp = ReactionPoint::new(LINE);
        let first = rp.on_cnp(Picos::ZERO, &p).unwrap();
        assert_eq!(rp.on_cnp(Picos(10), &p), None); // already pending
        let _ = rp.on_decrease_tick(first, &p);
        let again = rp.on_cnp(Picos::from_micros(9), &p).unwrap();
        assert_eq!(again, Picos(1 + 12_000_000));
        assert_eq!(rp.decreases, 1);
    }

    /// Driving a queue pair through CNPs gives what the same CNPs delivered one by one,
    /// with their decrease ticks, give; and it stops where the rate falls below the floor.
    #[test]
    fn driving_through_cnps_matches_the_events_one_by_one() {
        let p = DcqcnParams::default();
        let mut by_events = ReactionPoint::new(LINE);
        let _ = by_events.on_cnp(Picos::ZERO, &p);
        let mut driven = by_events.clone();
        let period = Picos::from_micros(50).0 + 37_000;
        let cnps = |from: u64| (1..).map(move |k| Picos(from + k * period));
        // One by one, as the engine would: each CNP, then its decrease tick.
        let until = Picos::from_micros(2_000);
        let mut pending = by_events.decrease_pending.then_some(by_events.decrease_at);
        for t in cnps(0).take_while(|&t| t < until) {
            if let Some(d) = pending.filter(|&d| d <= t) {
                let _ = by_events.on_decrease_tick(d, &p);
                pending = None;
            }
            if let Some(d) = by_events.on_cnp(t, &p) {
                pending = Some(d);
            }
        }
        if let Some(d) = pending.filter(|&d| d < until) {
            let _ = by_events.on_decrease_tick(d, &p);
        }
        assert_eq!(driven.drive(&mut cnps(0), until, 0.0, &p), None);
        // Equal but for rounding: the lazy alpha is caught up in other steps.
        assert!((driven.rate - by_events.rate).abs() < 1e-9 * by_events.rate);
        assert!((driven.alpha - by_events.alpha).abs() < 1e-12);
        let rounded = ReactionPoint {
            rate: by_events.rate,
            alpha: by_events.alpha,
            ..driven.clone()
        };
        assert_eq!(rounded, by_events);
        assert!(driven.decreases > 30 && driven.rate < LINE / 2.0);
        // With a floor it stops at the cut that crossed it.
        let mut floored = ReactionPoint::new(LINE);
        let _ = floored.on_cnp(Picos::ZERO, &p);
        let floor = 0.9 * LINE;
        let stop = floored.drive(&mut cnps(0), until, floor, &p).unwrap();
        assert!(floored.rate < floor && stop < until);
        // And at the increase timer, once the CNPs stop.
        let mut quiet = ReactionPoint::new(LINE);
        let first = quiet.on_cnp(Picos::ZERO, &p).unwrap();
        let _ = quiet.on_decrease_tick(first, &p);
        let timer = quiet.next_increase().unwrap();
        let none = &mut std::iter::empty();
        assert_eq!(
            quiet.drive(none, Picos::from_micros(5_000), 0.0, &p),
            Some(timer)
        );
    }

    #[test]
    fn rate_never_drops_below_the_minimum() {
        let p = DcqcnParams::default();
        let mut rp = ReactionPoint::new(LINE);
        let mut t = Picos::ZERO;
        for _ in 0..2000 {
            if let Some(d) = rp.on_cnp(t, &p) {
                let _ = rp.on_decrease_tick(d, &p);
                t = d;
            }
            t = Picos(t.0 + 1);
        }
        assert!((rp.rate - p.min_rate.0).abs() < 1e-6);
    }
}
