//! # The flow-level network model: max-min fair sharing on the real topology
//!
//! The packet-level model answers "what does the fabric do to these flows?" by simulating
//! every packet, queue and pause frame. This module answers the same question orders of
//! magnitude faster by assuming the fabric has already settled: every active flow sends at
//! its *max-min fair* rate on the links of its route, and that rate only changes when a
//! flow arrives or leaves.
//!
//! ## What it computes
//!
//! - **Release.** A flow of a [`FlowSet`] is released at the finish time of its last
//!   dependency (or at time zero if it has none) plus its own `delay`.
//! - **Route.** It takes the shortest path [`NetGraph::route_with`] picks for a
//!   deterministic hash of (source, destination, flow index), or for its destination alone
//!   where the graph pins paths, the same path every run.
//! - **Sharing.** Active flows share every directed link by max-min fairness, computed by
//!   progressive filling ([`max_min_rates`]): raise all rates together, freeze the flows of
//!   each link as it saturates, continue with the rest. Rates are recomputed at every
//!   release and every end of transmission. Only the flows connected to the change (through
//!   shared links, transitively) are recomputed: max-min fairness decomposes over those
//!   components, and [`Recompute::Full`] keeps the straightforward whole-network
//!   recomputation as the reference the fast path is tested against.
//! - **Completion.** Between events each flow drains its remaining bytes at its rate; its
//!   last byte leaves the source when they reach zero. The flow *finishes* when that byte
//!   arrives: the sum of the propagation delays of its route later. So one flow alone on a
//!   path of bottleneck bandwidth `B` finishes `bytes / B + sum(delays)` after its release;
//!   its first byte arrives after the propagation delay alone.
//! - **Report.** [`SimReport`] with model `"flow"`: each flow's release and finish, the end
//!   of the last flow, the payload bytes each link carried (the bytes of every flow routed
//!   over it), no PFC pauses, no drops, bytes sent = bytes delivered.
//!
//! ## Time and numbers
//!
//! Time is integer picoseconds, and events are ordered by [`orrery_des`]'s (time, sequence)
//! queue; floats never order events. Rates are `f64` bytes per second. A flow's remaining
//! bytes are brought up to date only when *its* rate changes, and its end of transmission
//! is then scheduled at `now + remaining / rate` rounded to the nearest picosecond, so a
//! flow whose rate never changes finishes exactly at its closed-form time, and no error
//! accumulates over the events of unrelated flows. Events that fall on the same picosecond
//! are handled together, ends of transmission before releases, each group in flow-index
//! order, followed by one rate recomputation: the outcome never depends on the order in
//! which events were scheduled.
//!
//! ## What it cannot see (honestly)
//!
//! This is steady-state fair sharing and nothing else. There is no congestion-control
//! dynamics (no DCQCN ramp-up, no convergence time, no unfairness between flows with
//! different round-trip times), no queueing (no queueing delay, no buffer occupancy, no
//! incast transient), no PFC pauses or head-of-line blocking, no ECN, no drops, no
//! packetisation (no per-packet headers except through [`FlowModelConfig::wire_overhead`],
//! no store-and-forward latency per hop: only propagation delay is added along the path),
//! and no ACK traffic on the reverse path. A flow's rate changes instantly when another
//! flow arrives or leaves. Where those effects matter (incast, deep congestion, PFC storms)
//! use the packet-level model; where the fabric is uncongested or contention is steady the
//! two should agree closely.

use crate::flows::FlowSet;
use crate::sim::{FlowOutcome, FlowSimulator, SimError, SimProgress, SimReport, PROGRESS_EVERY};
use crate::topology::{mix, NetGraph};
use orrery_des::{EventKey, EventQueue, HeapQueue};
use orrery_units::{NodeId, Picos, PICOS_PER_SEC};

/// How the rates are recomputed after an arrival or departure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Recompute {
    /// Only the flows connected (through shared links, transitively) to the flows that
    /// arrived or left. Gives the same rates, bit for bit, as [`Recompute::Full`]. It pays
    /// a search of the flow-link graph per event: where every flow shares one bottleneck
    /// it is somewhat slower than `Full`, where traffic falls into many independent groups
    /// (rings on disjoint rails, pairs) it is many times faster.
    #[default]
    Affected,
    /// Every active flow, every time: the slow reference path.
    Full,
}

/// Settings of the flow-level model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FlowModelConfig {
    /// Bytes put on the wire per payload byte: a flow of `b` payload bytes occupies links
    /// as if it were `b * wire_overhead` bytes long. Default 1.0: no overhead (headers,
    /// ACKs and protocol inefficiency are not modelled). A value for RoCEv2 with a 4096-byte
    /// MTU and ~58 bytes of headers per packet would be about 1.014. Values that are not
    /// finite or are below 1.0 are treated as 1.0 (see [`FlowModelConfig::effective_overhead`]).
    /// Reported link bytes are payload bytes regardless.
    pub wire_overhead: f64,
    /// Which flows' rates are recomputed at each event (an optimisation; results are equal).
    pub recompute: Recompute,
}

impl Default for FlowModelConfig {
    fn default() -> FlowModelConfig {
        FlowModelConfig {
            wire_overhead: 1.0,
            recompute: Recompute::Affected,
        }
    }
}

impl FlowModelConfig {
    /// The overhead factor actually applied: `wire_overhead` if finite and at least 1.0,
    /// otherwise 1.0.
    pub fn effective_overhead(&self) -> f64 {
        if self.wire_overhead.is_finite() && self.wire_overhead >= 1.0 {
            self.wire_overhead
        } else {
            1.0
        }
    }
}

/// The flow-level simulator: max-min fair sharing, recomputed at every arrival and departure.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct FlowLevelSimulator {
    pub config: FlowModelConfig,
}

impl FlowLevelSimulator {
    pub fn new(config: FlowModelConfig) -> FlowLevelSimulator {
        FlowLevelSimulator { config }
    }
}

impl FlowSimulator for FlowLevelSimulator {
    fn name(&self) -> &'static str {
        "flow"
    }

    fn simulate(&self, graph: &NetGraph, flows: &FlowSet) -> Result<SimReport, SimError> {
        flows.check()?;
        let routes = Routes::build(graph, flows)?;
        run(graph, flows, &routes, &self.config, &mut |_| {})
    }

    fn simulate_with_progress(
        &self,
        graph: &NetGraph,
        flows: &FlowSet,
        progress: &mut dyn FnMut(SimProgress),
    ) -> Result<SimReport, SimError> {
        flows.check()?;
        let routes = Routes::build(graph, flows)?;
        run(graph, flows, &routes, &self.config, progress)
    }
}

/// The ECMP hash of connection `index` from endpoint `src` to endpoint `dst`.
pub fn flow_hash(src: u32, dst: u32, index: usize) -> u64 {
    mix(mix((u64::from(src) << 32) | u64::from(dst)) ^ index as u64)
}

/// Each flow's connection number: which queue pair between its two endpoints carries it.
///
/// A flow that continues a chain of its collective between the same two endpoints
/// ([`FlowSet::chain_predecessors`]) goes on its predecessor's connection; any other flow
/// opens the next connection of its collective between the pair. A ring's step after step
/// between two ranks, a pipelined chain's chunk after chunk over one hop and an
/// all-reduce's reduce-scatter half continuing into its all-gather half are each one
/// connection, as NCCL sends every step of a channel over that channel's queue pair; its
/// parallel channels are distinct connections. The k-th connection between a pair is the
/// same in every collective (as a communicator reuses its queue pairs), so the ECMP hash of
/// `(src, dst, connection)` puts a repeated collective on the same paths every time: its
/// contention is the same, as on a real fabric, and the packet model's memoization can
/// recognise it.
///
/// (Earlier every flow of a collective between a pair opened a new connection, so each
/// ring step was hashed afresh and its collisions changed from step to step, which no
/// RoCE fabric does to one queue pair: collisions averaged out over a ring's steps that
/// persist on a real fabric.)
pub fn connection_numbers(flows: &FlowSet) -> Vec<usize> {
    let mut opened: crate::word_hash::WordMap<(u32, u32, u32), usize> = Default::default();
    let mut connection: Vec<usize> = Vec::with_capacity(flows.flows.len());
    let predecessors = flows.chain_predecessors(|_, _| true);
    for (f, prev) in flows.flows.iter().zip(predecessors) {
        let k = match prev {
            Some(d) => connection[d],
            None => {
                let n = opened.entry((f.collective, f.src, f.dst)).or_insert(0);
                *n += 1;
                *n - 1
            }
        };
        connection.push(k);
    }
    connection
}

/// Max-min fair rates by progressive filling.
///
/// `capacities[l]` is the capacity of link `l`; `flow_links[f]` lists the links flow `f`
/// crosses. Returns each flow's rate, in the unit of the capacities. Every flow's rate is
/// limited by its most constraining link: no link carries more than its capacity, and every
/// flow crosses at least one saturated link on which no other flow gets more.
///
/// Conventions for odd input (never a panic): a link listed twice by one flow counts once;
/// link indices out of range are ignored; a flow that crosses no (valid) link, or only
/// links of infinite capacity, gets `f64::INFINITY`; negative or NaN capacities count as 0.
pub fn max_min_rates(capacities: &[f64], flow_links: &[Vec<usize>]) -> Vec<f64> {
    let nl = capacities.len();
    let mut paths = Vec::new();
    let mut starts = Vec::with_capacity(flow_links.len() + 1);
    let mut link_flows: Vec<Vec<u32>> = vec![Vec::new(); nl];
    starts.push(0);
    for (f, links) in flow_links.iter().enumerate() {
        let mut p: Vec<u32> = links
            .iter()
            .filter(|&&l| l < nl)
            .map(|&l| l as u32)
            .collect();
        p.sort_unstable();
        p.dedup();
        for &l in &p {
            link_flows[l as usize].push(f as u32);
        }
        paths.extend_from_slice(&p);
        starts.push(paths.len());
    }
    let used: Vec<u32> = (0..nl as u32)
        .filter(|&l| !link_flows[l as usize].is_empty())
        .collect();
    let mut rates = vec![f64::INFINITY; flow_links.len()];
    let mut solver = Solver::new(nl, flow_links.len());
    solver.solve(
        &used,
        capacities,
        &link_flows,
        |f| &paths[starts[f]..starts[f + 1]],
        &mut rates,
    );
    rates
}

/// Reusable workspace of progressive filling.
struct Solver {
    cap: Vec<f64>,
    unfrozen: Vec<u32>,
    frozen_epoch: Vec<u32>,
    epoch: u32,
    live: Vec<u32>,
    bottlenecks: Vec<u32>,
}

impl Solver {
    fn new(links: usize, flows: usize) -> Solver {
        Solver {
            cap: vec![0.0; links],
            unfrozen: vec![0; links],
            frozen_epoch: vec![0; flows],
            epoch: 0,
            live: Vec::new(),
            bottlenecks: Vec::new(),
        }
    }

    /// Progressive filling over `links` (ascending; every flow on them must have all its
    /// links in `links`), writing the rate of every flow on them into `rates`.
    ///
    /// The arithmetic on one link depends only on the flows of its own component, and
    /// always happens in the same order (bottleneck links ascending, their flows ascending),
    /// so solving a component alone gives bit-identical rates to solving it with others.
    fn solve<'p>(
        &mut self,
        links: &[u32],
        capacities: &[f64],
        link_flows: &[Vec<u32>],
        path: impl Fn(usize) -> &'p [u32],
        rates: &mut [f64],
    ) {
        self.epoch = self.epoch.wrapping_add(1);
        if self.epoch == 0 {
            self.frozen_epoch.iter_mut().for_each(|e| *e = 0);
            self.epoch = 1;
        }
        let epoch = self.epoch;
        self.live.clear();
        for &l in links {
            let li = l as usize;
            let c = capacities[li];
            self.cap[li] = if c.is_nan() { 0.0 } else { c.max(0.0) };
            self.unfrozen[li] = link_flows[li].len() as u32;
            if self.unfrozen[li] > 0 {
                self.live.push(l);
            }
        }
        while !self.live.is_empty() {
            let mut level = f64::INFINITY;
            for &l in &self.live {
                let li = l as usize;
                let share = self.cap[li] / f64::from(self.unfrozen[li]);
                if share < level {
                    level = share;
                }
            }
            if level == f64::INFINITY {
                // Only unbounded links remain: their flows are unconstrained.
                for &l in &self.live {
                    for &f in &link_flows[l as usize] {
                        if self.frozen_epoch[f as usize] != epoch {
                            self.frozen_epoch[f as usize] = epoch;
                            rates[f as usize] = f64::INFINITY;
                        }
                    }
                }
                break;
            }
            self.bottlenecks.clear();
            for &l in &self.live {
                let li = l as usize;
                if self.cap[li] / f64::from(self.unfrozen[li]) == level {
                    self.bottlenecks.push(l);
                }
            }
            for &b in &self.bottlenecks {
                for &f in &link_flows[b as usize] {
                    let fi = f as usize;
                    if self.frozen_epoch[fi] == epoch {
                        continue;
                    }
                    self.frozen_epoch[fi] = epoch;
                    rates[fi] = level;
                    for &m in path(fi) {
                        let mi = m as usize;
                        self.cap[mi] = (self.cap[mi] - level).max(0.0);
                        self.unfrozen[mi] -= 1;
                    }
                }
            }
            let unfrozen = &self.unfrozen;
            self.live.retain(|&l| unfrozen[l as usize] > 0);
        }
    }
}

/// Every flow's route, as links, with its propagation delay.
struct Routes {
    starts: Vec<usize>,
    links: Vec<u32>,
    delay: Vec<Picos>,
}

impl Routes {
    fn build(graph: &NetGraph, flows: &FlowSet) -> Result<Routes, SimError> {
        let n = flows.flows.len();
        // Route flows grouped by destination so each BFS runs once and only one distance
        // table is alive at a time.
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by_key(|&i| (flows.flows[i].dst, i));
        let mut per_flow: Vec<Vec<u32>> = vec![Vec::new(); n];
        let mut delay = vec![Picos::ZERO; n];
        let mut cached: Option<(NodeId, Vec<u32>)> = None;
        let connection = connection_numbers(flows);
        for i in order {
            let f = &flows.flows[i];
            let src = graph.endpoint(f.src as usize)?;
            let dst = graph.endpoint(f.dst as usize)?;
            let dist = match &cached {
                Some((d, dist)) if *d == dst => dist,
                _ => &cached.insert((dst, graph.distances_to(dst))).1,
            };
            let path = graph.route_with(src, dst, flow_hash(f.src, f.dst, connection[i]), dist)?;
            delay[i] = path.iter().map(|&l| graph.link(l).delay).sum();
            per_flow[i] = path.iter().map(|l| l.0).collect();
        }
        let mut starts = Vec::with_capacity(n + 1);
        let mut links = Vec::new();
        starts.push(0);
        for p in per_flow {
            links.extend_from_slice(&p);
            starts.push(links.len());
        }
        Ok(Routes {
            starts,
            links,
            delay,
        })
    }

    fn path(&self, f: usize) -> &[u32] {
        &self.links[self.starts[f]..self.starts[f + 1]]
    }
}

#[derive(Debug, Clone, Copy)]
enum Event {
    Release(u32),
    TxDone(u32),
}

/// The state of one active flow.
#[derive(Debug, Clone, Copy)]
struct Active {
    /// Wire bytes still to send as of `mark`.
    remaining: f64,
    mark: Picos,
    /// Current rate, wire bytes per second (0 before the first computation).
    rate: f64,
    /// The pending end-of-transmission event.
    key: Option<EventKey>,
}

/// What finishing a flow updates.
struct Progress<'a> {
    queue: &'a mut HeapQueue<Event>,
    pending: &'a mut [u32],
    ready: &'a mut [Picos],
    outcomes: &'a mut [FlowOutcome],
    finished: &'a mut [bool],
}

fn run(
    graph: &NetGraph,
    set: &FlowSet,
    routes: &Routes,
    config: &FlowModelConfig,
    progress: &mut dyn FnMut(SimProgress),
) -> Result<SimReport, SimError> {
    let flows = &set.flows;
    let n = flows.len();
    let nl = graph.links().len();
    let overhead = config.effective_overhead();
    let capacities: Vec<f64> = graph.links().iter().map(|l| l.bandwidth.0).collect();

    // Dependents, as compressed rows.
    let mut pending: Vec<u32> = flows.iter().map(|f| f.deps.len() as u32).collect();
    let mut dep_starts = vec![0usize; n + 1];
    for f in flows {
        for d in &f.deps {
            dep_starts[d.index() + 1] += 1;
        }
    }
    for i in 0..n {
        dep_starts[i + 1] += dep_starts[i];
    }
    let mut fill = dep_starts.clone();
    let mut dependents = vec![0u32; dep_starts[n]];
    for (i, f) in flows.iter().enumerate() {
        for d in &f.deps {
            dependents[fill[d.index()]] = i as u32;
            fill[d.index()] += 1;
        }
    }
    let mut ready = vec![Picos::ZERO; n];

    let mut outcomes = vec![FlowOutcome::default(); n];
    let mut finished = vec![false; n];
    let mut states: Vec<Option<Active>> = vec![None; n];
    let mut link_flows: Vec<Vec<u32>> = vec![Vec::new(); nl];
    let mut rates = vec![0.0f64; n];
    let mut solver = Solver::new(nl, n);

    let mut queue: HeapQueue<Event> = HeapQueue::new();
    for (i, f) in flows.iter().enumerate() {
        if f.deps.is_empty() {
            queue.schedule(f.delay, Event::Release(i as u32));
        }
    }

    let mut events = 0u64;
    let mut done_now: Vec<u32> = Vec::new();
    let mut released_now: Vec<u32> = Vec::new();
    let mut dirty: Vec<u32> = Vec::new();
    let mut link_seen = vec![0u32; nl];
    let mut flow_seen = vec![0u32; n];
    let mut seen_epoch = 0u32;
    let mut comp_links: Vec<u32> = Vec::new();
    let mut comp_flows: Vec<u32> = Vec::new();
    let mut stack: Vec<u32> = Vec::new();

    let mut flows_done = 0usize;
    let mut next_report = 0u64;
    while let Some(now) = queue.peek_time() {
        if events >= next_report {
            progress(SimProgress {
                now,
                flows_done,
                flows_total: n,
                events,
            });
            next_report = events + PROGRESS_EVERY;
        }
        done_now.clear();
        released_now.clear();
        while queue.peek_time() == Some(now) {
            let Some((_, ev)) = queue.pop() else { break };
            events += 1;
            match ev {
                Event::Release(f) => released_now.push(f),
                Event::TxDone(f) => done_now.push(f),
            }
        }
        done_now.sort_unstable();
        released_now.sort_unstable();
        dirty.clear();
        // For progress reports only (zero-byte flows finish without a transmission end).
        flows_done += done_now.len();

        // Ends of transmission: leave the links, finish after the propagation delay,
        // release the dependents whose last dependency this was.
        let finish_flow = |f: usize, st: &mut Progress<'_>| {
            st.finished[f] = true;
            let finish = now + routes.delay[f];
            st.outcomes[f].finish = finish;
            for &d in &dependents[dep_starts[f]..dep_starts[f + 1]] {
                let di = d as usize;
                st.ready[di] = st.ready[di].max(finish + flows[di].delay);
                st.pending[di] -= 1;
                if st.pending[di] == 0 {
                    st.queue.schedule(st.ready[di], Event::Release(d));
                }
            }
        };
        for &f in &done_now {
            let fi = f as usize;
            states[fi] = None;
            for &l in routes.path(fi) {
                let lf = &mut link_flows[l as usize];
                if let Ok(pos) = lf.binary_search(&f) {
                    lf.remove(pos);
                }
                dirty.push(l);
            }
            finish_flow(
                fi,
                &mut Progress {
                    queue: &mut queue,
                    pending: &mut pending,
                    ready: &mut ready,
                    outcomes: &mut outcomes,
                    finished: &mut finished,
                },
            );
        }
        // Releases: join the links (a flow with nothing to send finishes at once).
        for &f in &released_now {
            let fi = f as usize;
            outcomes[fi].start = now;
            let wire = flows[fi].bytes.as_f64() * overhead;
            if wire <= 0.0 {
                finish_flow(
                    fi,
                    &mut Progress {
                        queue: &mut queue,
                        pending: &mut pending,
                        ready: &mut ready,
                        outcomes: &mut outcomes,
                        finished: &mut finished,
                    },
                );
                continue;
            }
            states[fi] = Some(Active {
                remaining: wire,
                mark: now,
                rate: 0.0,
                key: None,
            });
            for &l in routes.path(fi) {
                let lf = &mut link_flows[l as usize];
                if let Err(pos) = lf.binary_search(&f) {
                    lf.insert(pos, f);
                }
                dirty.push(l);
            }
        }
        if dirty.is_empty() {
            continue;
        }

        // Which flows to recompute, over which links.
        seen_epoch = seen_epoch.wrapping_add(1);
        if seen_epoch == 0 {
            link_seen.iter_mut().for_each(|e| *e = 0);
            flow_seen.iter_mut().for_each(|e| *e = 0);
            seen_epoch = 1;
        }
        comp_links.clear();
        comp_flows.clear();
        match config.recompute {
            Recompute::Full => {
                for (l, lf) in link_flows.iter().enumerate() {
                    if !lf.is_empty() {
                        comp_links.push(l as u32);
                    }
                }
                for (f, s) in states.iter().enumerate() {
                    if s.is_some() {
                        comp_flows.push(f as u32);
                    }
                }
            }
            Recompute::Affected => {
                stack.clear();
                for &l in &dirty {
                    if link_seen[l as usize] != seen_epoch {
                        link_seen[l as usize] = seen_epoch;
                        stack.push(l);
                    }
                }
                while let Some(l) = stack.pop() {
                    if link_flows[l as usize].is_empty() {
                        continue;
                    }
                    comp_links.push(l);
                    for &f in &link_flows[l as usize] {
                        if flow_seen[f as usize] == seen_epoch {
                            continue;
                        }
                        flow_seen[f as usize] = seen_epoch;
                        comp_flows.push(f);
                        for &m in routes.path(f as usize) {
                            if link_seen[m as usize] != seen_epoch {
                                link_seen[m as usize] = seen_epoch;
                                stack.push(m);
                            }
                        }
                    }
                }
                // The solver's arithmetic order (hence its bits) follows the link order; the
                // flows' order does not matter (same-time events are sorted when popped).
                comp_links.sort_unstable();
            }
        }
        solver.solve(
            &comp_links,
            &capacities,
            &link_flows,
            |f| routes.path(f),
            &mut rates,
        );

        // Flows whose rate changed: bring their remaining bytes up to date and move their
        // end of transmission. Flows whose rate did not change keep their scheduled end.
        for &f in &comp_flows {
            let fi = f as usize;
            let Some(st) = states[fi].as_mut() else {
                continue;
            };
            let rate = rates[fi];
            if rate == st.rate {
                continue;
            }
            let elapsed = (now - st.mark).0 as f64 / PICOS_PER_SEC;
            st.remaining = (st.remaining - st.rate * elapsed).max(0.0);
            st.mark = now;
            st.rate = rate;
            if rate > 0.0 && !rate.is_nan() {
                let at = now + Picos::from_secs_f64(st.remaining / rate);
                st.key = Some(match st.key.and_then(|k| queue.reschedule(k, at)) {
                    Some(k) => k,
                    None => queue.schedule(at, Event::TxDone(f)),
                });
            } else if let Some(k) = st.key.take() {
                // Cannot happen on a valid graph (positive bandwidths); such a flow never
                // finishes and is reported as unfinished.
                queue.cancel(k);
            }
        }
    }

    let mut link_bytes = vec![0u64; nl];
    let mut total = 0u64;
    for (i, f) in flows.iter().enumerate() {
        total = total.saturating_add(f.bytes.0);
        for &l in routes.path(i) {
            link_bytes[l as usize] = link_bytes[l as usize].saturating_add(f.bytes.0);
        }
    }
    // Every event is scheduled at or after the current time by construction.
    debug_assert_eq!(queue.clamped_schedules(), 0);
    let unfinished = finished.iter().filter(|d| !**d).count();
    if unfinished > 0 {
        return Err(SimError::Unfinished { unfinished });
    }
    let end = crate::sim::last_finish(&outcomes);
    Ok(SimReport {
        model: "flow".to_string(),
        flows: outcomes,
        end,
        link_bytes,
        pfc_pauses: vec![0; nl],
        drops: 0,
        bytes_sent: total,
        bytes_delivered: total,
        events,
        accel: Default::default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_link_is_shared_equally() {
        let r = max_min_rates(&[12.0], &[vec![0], vec![0], vec![0]]);
        assert_eq!(r, vec![4.0, 4.0, 4.0]);
    }

    #[test]
    fn odd_input_follows_the_documented_conventions() {
        // Repeated link counts once; out-of-range index ignored; no link: unconstrained.
        let r = max_min_rates(&[2.0], &[vec![0, 0], vec![0, 7], vec![], vec![9]]);
        assert_eq!(r, vec![1.0, 1.0, f64::INFINITY, f64::INFINITY]);
        // NaN and negative capacities count as zero; infinite capacity never binds.
        let r = max_min_rates(
            &[f64::NAN, -1.0, f64::INFINITY],
            &[vec![0], vec![1, 2], vec![2]],
        );
        assert_eq!(r, vec![0.0, 0.0, f64::INFINITY]);
        assert!(max_min_rates(&[], &[]).is_empty());
    }

    #[test]
    fn solving_a_component_alone_is_bit_identical() {
        // Two components: {links 0, 1} and {links 2, 3}, with awkward capacities.
        let caps = [1.0 / 3.0, 0.7, 0.1 + 0.2, 5.0 / 7.0];
        let paths: Vec<Vec<u32>> = vec![vec![0, 1], vec![2, 3], vec![0], vec![3], vec![1], vec![2]];
        let mut link_flows: Vec<Vec<u32>> = vec![Vec::new(); 4];
        for (f, p) in paths.iter().enumerate() {
            for &l in p {
                link_flows[l as usize].push(f as u32);
            }
        }
        let mut solver = Solver::new(4, paths.len());
        let mut all = vec![0.0; paths.len()];
        solver.solve(&[0, 1, 2, 3], &caps, &link_flows, |f| &paths[f], &mut all);
        let mut parts = vec![0.0; paths.len()];
        solver.solve(&[0, 1], &caps, &link_flows, |f| &paths[f], &mut parts);
        solver.solve(&[2, 3], &caps, &link_flows, |f| &paths[f], &mut parts);
        assert_eq!(
            all.iter().map(|r| r.to_bits()).collect::<Vec<_>>(),
            parts.iter().map(|r| r.to_bits()).collect::<Vec<_>>()
        );
    }

    #[test]
    fn flow_hashes_are_stable_and_spread() {
        assert_eq!(flow_hash(1, 2, 3), flow_hash(1, 2, 3));
        assert_ne!(flow_hash(1, 2, 3), flow_hash(1, 2, 4));
        assert_ne!(flow_hash(1, 2, 3), flow_hash(2, 1, 3));
    }

    /// A ring's steps between two ranks ride one connection per channel, in both halves
    /// of an all-reduce, and a second collective of the same shape gets the same numbers;
    /// an all-to-all opens one connection per pair.
    #[test]
    fn connections_follow_chains_not_steps() {
        use crate::flows::{collective_flows, FlowAlgorithm};
        use crate::CollectiveKind;
        use orrery_units::Bytes;
        let mut set = FlowSet::default();
        let ranks: Vec<u32> = (0..8).collect();
        let step = Picos::from_nanos(1000);
        for name in ["first", "second"] {
            let ring = FlowAlgorithm::Ring { channels: 2 };
            let (kind, bytes) = (CollectiveKind::AllReduce, Bytes(1 << 20));
            collective_flows(&mut set, name, kind, ring, &ranks, bytes, 8, step).unwrap();
        }
        let (kind, a2a) = (CollectiveKind::AllToAll, FlowAlgorithm::Direct);
        collective_flows(&mut set, "a2a", kind, a2a, &ranks, Bytes(1 << 20), 8, step).unwrap();
        let connection = connection_numbers(&set);
        let per_collective = |c: u32| -> std::collections::BTreeSet<(u32, u32, usize)> {
            set.flows
                .iter()
                .zip(&connection)
                .filter(|(f, _)| f.collective == c)
                .map(|(f, &k)| (f.src, f.dst, k))
                .collect()
        };
        let (first, second, a2a) = (per_collective(0), per_collective(1), per_collective(2));
        // 8 ranks x 2 channels x 14 steps each, on 16 connections.
        assert_eq!(
            set.flows.iter().filter(|f| f.collective == 0).count(),
            8 * 2 * 14
        );
        assert_eq!(first.len(), 16, "{first:?}");
        assert!(first.iter().all(|&(_, _, k)| k < 2));
        assert_eq!(first, second);
        assert_eq!(a2a.len(), 8 * 7);
        assert!(a2a.iter().all(|&(_, _, k)| k == 0));
    }

    #[test]
    fn config_defaults_and_overhead_clamping() {
        let c = FlowModelConfig::default();
        assert_eq!(c.wire_overhead, 1.0);
        assert_eq!(c.recompute, Recompute::Affected);
        for bad in [0.5, f64::NAN, f64::INFINITY, -2.0] {
            let c = FlowModelConfig {
                wire_overhead: bad,
                ..c
            };
            assert_eq!(c.effective_overhead(), 1.0);
        }
        assert_eq!(FlowLevelSimulator::default().name(), "flow");
    }
}
