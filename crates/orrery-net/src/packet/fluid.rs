//! # The fluid model: the packet model's fabric, with bytes as a fluid
//!
//! The packet model ([`super::PacketSimulator`]) spends its events on packets; where flows
//! collide, DCQCN keeps them in a transient (marks, cuts, a PFC-held queue, recovery) for
//! milliseconds, and no steady state lets its fast-forward skip them. This model follows
//! the same fabric, under the same [`PacketConfig`], with each flow's bytes as a fluid
//! moved in fixed time steps (`step`, 500 ns by default, or the shortest delay of a link
//! the flows use if that is shorter: 200 ns where they cross a DGX-like host's NVLink):
//! what it keeps from the packet model is what decides a congested flow's course.
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
//!   ACKs take their bytes from each link of that path first (control frames have strict
//!   priority): the receiver's own link in the step the data reaches it, each further
//!   link its predecessors' delays later ([`Fluid::schedule_acks`]). Loading every link
//!   of the path one step after the data instead (until 2026-12-07) put the ACKs on a
//!   NIC's link a step late, against the data it sends itself, and on far links early:
//!   a ring's cable steps each finished ~19 ns late (0.55%), the 1 GiB ring example's
//!   NVLink steps were 51% off on average (11% now), its end 0.21% (0.006% now).
//! - **Completion.** A flow finishes when its last byte reaches the receiver (interpolated
//!   within the step), plus one frame's serialisation per switch it crosses (the packet
//!   model stores and forwards whole frames; a fluid is cut through).
//!
//! Simplified (approximations of the packet model, on purpose): marks are expectations,
//! not draws, so a receiver sends its CNP when a marked packet is due on average rather
//! than at the first marked packet a draw gives; rates change on step boundaries; a paused
//! port's in-flight bytes count against the shared pool rather than its headroom; CNPs and
//! PFC frames take no bandwidth; a flow's ACKs reach a link in the step its delay ends
//! in, not at its instant; there are no drops, retransmissions or timeouts (PFC is
//! assumed, as in the defaults). Time is integer picoseconds at step boundaries and in
//! every reported time; the fluid amounts are `f64`, control loads, buffer use and link
//! capacities on a grid of 1/1024 byte ([`GRID`]). The model is deterministic: no random numbers at all. Its
//! report counts the steps it took as its events (idle stretches and the steps between
//! strided links' transmissions, skipped, count none: they are its skipped events).
//!
//! ## Links stepped at their own length (`longest_link_step`)
//!
//! The step is the shortest delay of a link the flows use, so one NVLink hop (200 ns) sets
//! it for the 1 us cables too, and a step's cost is the parts it moves, hop by hop. With
//! `longest_link_step` (by default 1 us where a link shorter than the step asked for holds
//! the step below it, and no striding where the step is the one asked for), a link whose
//! delay spans several steps transmits only at steps
//! that are multiples of its *stride* (the largest divisor of its delay in steps whose
//! length stays within the bound), each time for that many steps: its room, control
//! frames, marks and its port's water-filling cover the stride, and its parts keep their
//! times in base steps from the step they were sent at, so where they land (a stride of
//! steps later, on a step its next hop transmits at, if alike) and when a receiver gets
//! their bytes is as precise as before (a part that a link with a longer stride hands to
//! one with a shorter counts as arriving by the end of the shorter's step; the fabrics
//! here have no such hop). A queue pair released inside its port's stride sends from its
//! release in what the stride has left ([`Fluid::serve_late_joins`]).
//! Measured: with cables every 1 us, the ECMP GPT 350M step at 1,024 GPUs takes 3.2 s
//! instead of 8.8 s, its errors against the reference as small, and an uncongested ring
//! and a lone flow give the same picoseconds as stepping every link; where DCQCN's course
//! is set on the cables themselves (the 8-to-1 incast at 100 Gb/s, its 1 us links at two
//! 500 ns steps) the end moves from 0.32% to 0.51% off (docs/benchmarks.md), which is why
//! the default strides links only where a shorter link has already taken the step below
//! the one asked for: there the longer links would otherwise be stepped finer than asked,
//! and the fabrics measured so (NVLink hosts on 1 us cables) kept their errors. A flow
//! whose links (data and ACKs) all share one stride is frozen as any other, its grant
//! per transmission; one whose links' strides differ is never frozen (a grant would
//! reach a link between its transmissions).
//!
//! ## Calm flows (`calm_skip`, on by default)
//!
//! Most flows of a training step spend most of their life calm: alone on their path or
//! sharing it with room to spare, their port granting them the same bytes every step,
//! nothing queued anywhere they go. Stepping them is pure repetition, so such a flow is
//! *frozen* ([`Fluid::try_freeze`]): once its port has granted it the same whole step (at
//! its rate, or all of a port it has to itself) for as long as its bytes take to cross its
//! path, every link of the path holds one such grant in flight per step of its delay,
//! nothing queued, paused or about to pause, its receiver took one grant in the last step
//! and the ACKs of its deliveries still on their way back are each one grant's (a flow that
//! delivered a draining queue's bytes a few steps before would leave their surplus on the
//! rings when its ACKs come off as grants': found by the bench's ECMP step at 1,024 GPUs,
//! one flow 21 ps off stepping every flow), its bytes in flight leave the rings and its
//! links keep its load per step (`frozen`, its ACKs' `frozen_ctrl`). Every link serves the
//! others with that load counted (a FIFO's last segment is that much longer, a port has
//! that much less room). It thaws ([`Fluid::thaw`]: the grants of the steps it missed added
//! one by one, its grants in flight put back on the rings, the one landing now into the
//! next FIFO or its receiver) at the latest two grants before its bytes run out or when its
//! DCQCN rate is due to rise; and earlier, before the step transmits, if anything reaches
//! one of its links ([`Fluid::thaw_where_reached`]): a pause, bytes older than the step in
//! a FIFO, more asked of a link than its room with the frozen load counted, or, for a flow
//! held to its port's room, any other sender or any other room. When every flow in flight
//! is frozen the run skips to the next release or thaw. On strided links the same holds per
//! transmission: the grant is a transmission's, one per transmission is in flight on each
//! link, the frozen loads count per transmission, and a thaw between two of them puts back
//! only the grants in flight (none lands then).
//!
//! The skip is exact, not approximate: with and without it, every run compared gave the
//! same bits (`tests/fluid.rs` checks random traffic, incasts with and without DCQCN and
//! a ring to the picosecond; the ECMP GPT 350M steps at 512 and 1,024 GPUs and the 405B
//! pipeline step were compared flow by flow, docs/benchmarks.md). The one sum that is not
//! exact is a FIFO segment's span where frozen and live bytes cross the link together
//! (the frozen share is added after the live bytes, not in flow order), a last-place
//! rounding that has changed no result measured. Three things make the rest exact. Where a frozen flow's bytes would
//! have been is decided by the same tests the slow path runs (a segment goes whole when
//! all but dust of it fits). Sums that would include or leave out a frozen flow's share
//! are exact whatever their terms (the grid). And nothing depends on the order links are
//! visited in beyond what a frozen flow leaves unchanged: each step's arrivals at a FIFO
//! form its segment in the order of their flows, and a frozen flow's links stay on the
//! active list as its bytes in flight would keep them. A step's arrivals in landing order,
//! floats summed in visiting order and links dropped from the list made the two runs drift
//! apart from the first rounding on the 1,024-GPU step (the end 0.03%, a collective's
//! finish 1.4%), as any perturbation of a congested step's rounding does.
//!
//! ## Steps between transmissions (`gap_skip`, on by default)
//!
//! With cables strided (every 1 us at 200 ns steps), most steps of a congested fabric
//! carry no NVLink bytes, and then nothing happens between the cables' transmissions: on
//! the ECMP GPT 350M step at 1,024 GPUs, 278,709 of the 292,246 steps taken had no link
//! listed that transmits every step, and 222,792 of those fell between transmissions,
//! each visiting some 470 listed links only to find none due. [`Fluid::skip_gap`] goes
//! from such a step straight to the next multiple of a stride. A step skipped would have
//! done nothing, which holds by construction where every listed link is strided or
//! listed only for frozen flows' loads (an NVLink hop carrying a calm flow: nothing lands
//! on it, queues or waits to be sent, so its transmissions send nothing): a strided link
//! transmits at multiples of its stride and its bytes land at multiples too (its stride
//! divides its delay; queue pairs released inside a window are launched with it), so no
//! landing, arrival or transmission falls in between; rates are driven only where a port
//! transmits; PFC's thresholds and the buffers they read change only at landings and
//! transmissions. What else could happen there stops the skip: a release
//! (it joins its port at its step), a pause or resume reaching its transmitter, a frozen
//! flow's thaw, an ACK due at a strided link between its transmissions (a reverse path
//! of mixed strides; no skip until the latest such has come), a thaw forced by something
//! that reached a frozen flow's link by the first step skipped (a demand that grows once
//! a queue pair's first partial window is past), and a pause or resume PFC would send.
//! The ACKs that reach the listed links by the step taken are put on them as the last step
//! skipped would have (their loads are on the grid, so none of this moves a bit).
//! Measured: every output compared is identical with and without it (`tests/fluid.rs`:
//! random traffic, an NVLink ring, an incast with PFC pauses, a switch of three strides
//! whose ACKs fall between transmissions, which fails without the wait for them; the unit
//! test below sets up each stop condition alone; the five
//! example scenarios, the bench's GPT, Mixtral and ring steps and the 405B step, flow by
//! flow; docs/benchmarks.md). The ECMP step at 1,024 GPUs takes 81,729 steps instead of
//! 292,246. `--fluid-no-gap-skip` takes every step.
//!
//! ## Symmetric traffic (`symmetry`, on by default)
//!
//! Traffic that repeats itself host by host, or GPU by GPU, is stepped as one copy: the
//! packet model's symmetry search (its `symmetry` module, through `simulate_reduced`) gives
//! the quotient, one flow per orbit on one link per orbit, and a switch that stands for
//! several alike counts each byte it holds that many times against its shared pool
//! (`Fluid::buffer_copies`, as the packet model's buffers do), so its PFC thresholds see
//! the whole fabric's occupancy. The packet model's copies part where ECN's draws differ;
//! the fluid model draws nothing, so every copy of an orbit follows the one course the
//! quotient steps. What could still differ is rounding: the quotient numbers its flows
//! afresh, and sums over a step's flows (a FIFO segment's shares) take their terms in flow
//! order. Nothing did where compared: the same picoseconds, bytes and pauses as stepping
//! every copy (`tests/fluid.rs`: a 4-channel ring over four hosts, four 4-to-1 incasts with
//! PFC pauses, an all-to-all; `ring-allreduce-128`, `gpt-step-128` and the bench's ring,
//! GPT 350M at 128 GPUs, Mixtral and 405B steps, docs/benchmarks.md). Where flows of one packet are left out of the check (a
//! gradient norm over a tree), each is stepped on its own, without its copies' frames
//! beside it, and the flows after it are timed through their own dependencies: there the
//! step of `tests/fluid.rs` is 0.03% off per flow on average, its end exact. ECMP's hashes
//! are not symmetric, so ECMP traffic is seldom reduced.
//!
//! What it does not do: it does not replace the packet model where packets matter (a few
//! packets per flow, losses without PFC, a mark's draw deciding a race), and it steps
//! every flow that is not calm every step: where flows collide (ECMP across pods), its
//! cost is the steps they are in flight times the hops they occupy. It does not
//! accelerate the packet model; it is the measured candidate for the course of a congested
//! partition that the packet model's fast-forward cannot jump (docs/benchmarks.md).

use super::config::{EcnThresholds, PacketConfig};
use super::dcqcn::ReactionPoint;
use super::engine::Routes;
use super::symmetry::{simulate_reduced, Quotient, ReducedRun};
use super::SymmetryShift;
use crate::flows::FlowSet;
use crate::sim::{FlowOutcome, FlowSimulator, SimError, SimProgress, SimReport, PROGRESS_EVERY};
use crate::topology::NetGraph;
use orrery_units::{Picos, PICOS_PER_SEC};
use std::collections::VecDeque;

mod calm;

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
/// Control frames' loads, buffer use and link capacities are kept on a grid of 1/1024
/// byte: sums of such values are exact in `f64` whatever their order, so a frozen flow's
/// load counted apart (see [`Fluid::try_freeze`]) gives the same bits.
const GRID: f64 = 1024.0;

/// `v` (not negative: bytes) to the nearest point of the grid, halves up. By integer
/// conversion: `f64::round` is a library call on the baseline x86-64 target, and this runs
/// for every part at every hop.
fn on_grid(v: f64) -> f64 {
    debug_assert!(v >= 0.0, "{v}");
    ((v * GRID + 0.5) as u64) as f64 / GRID
}

/// The bit of [`Link::ring_bits`] that stands for ring slot `slot`.
fn slot_bit(slot: usize) -> u64 {
    1 << (slot & 63)
}

/// Steps per transmission of a link whose delay is `delay_steps` steps: the largest
/// divisor of that delay no longer than `longest`, so what it sends at one of its
/// transmissions lands on a step it transmits at again (its next hop, if alike, too).
fn stride_for(delay_steps: usize, longest: usize) -> u64 {
    (1..=longest.min(delay_steps))
        .rev()
        .find(|s| delay_steps.is_multiple_of(*s))
        .unwrap_or(1) as u64
}

/// Turns the times of parts a link sent for `stride` steps from fractions of those steps
/// into fractions of one step, as every part keeps them; returns their wire bytes.
fn in_steps(sent: &mut [Part], stride: f64) -> f64 {
    let mut wire = 0.0;
    for p in sent.iter_mut() {
        p.begin *= stride;
        p.end *= stride;
        wire += p.wire;
    }
    wire
}

/// The most steps a link may transmit for at once (a bound on a typo, not a tuning).
const MAX_STRIDE: u64 = 1 << 16;

/// The fewest steps a calm flow is frozen for: a shorter freeze saves less than checking
/// its path and putting it back cost.
const MIN_FREEZE_STEPS: u64 = 16;

/// The fluid model under the packet model's configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct FluidSimulator {
    /// The fabric: buffers, PFC, ECN, DCQCN, packet sizes (the acceleration settings are
    /// not used).
    pub config: PacketConfig,
    /// The time step: at most this, and never longer than the shortest delay of a link
    /// the flows use. Default 500 ns (25 frames of 1,000 bytes at 400 Gb/s, half a 1 us
    /// cable's delay). Rates, pauses and a FIFO's segments change on step boundaries;
    /// completions and CNPs are placed within the step. Measured against the packet
    /// model's reference (docs/benchmarks.md, 2026-12-07): on the Llama 3 405B pipeline
    /// step (128 GPUs, every flow on 1 us cables) 250 ns, 500 ns and 1 us steps gave the
    /// same per-flow errors (0.21% mean, 1.4% to 1.5% at p99) in 0.26, 0.12 and 0.06 s; on
    /// the 8-to-1 incast at 100 Gb/s the end 0.37%, 0.32% and 0.51% off. 250 ns until then.
    pub step: Picos,
    /// Let links whose delay spans several steps transmit once every few of them, for as
    /// many: each at the longest multiple of the step that divides its delay and is at
    /// most this (`Some` of the step or less: every link every step). `None`, the
    /// default, chooses: [`FluidSimulator::DEFAULT_LINK_STEP`] (1 us) where a link
    /// shorter than `step` holds the step below it (a host's NVLink, 200 ns), every link
    /// every step otherwise, so the step asked for is what the longer links (1 us
    /// cables) get at least. With 1 us the ECMP GPT 350M step at 1,024 GPUs takes 3.2 s
    /// instead of 8.8 s, as close to the reference (docs/benchmarks.md). A flow whose
    /// links do not all share one stride is never frozen; a flow released inside its
    /// port's window sends from its release in what the window has left.
    pub longest_link_step: Option<Picos>,
    /// Freeze calm flows (on by default): a flow that has sent the same bytes every step
    /// for as long as its path takes to carry them, on a path with no queue, is taken out
    /// of the steps and moved on in closed form until something reaches its links (see
    /// the module's docs). Off, every flow in flight is stepped.
    pub calm_skip: bool,
    /// Step one copy of traffic that repeats itself host by host or GPU by GPU (on by
    /// default): the packet model's symmetry reduction (its `symmetry` module), flows of
    /// one packet left out of the check as there. See "Symmetric traffic" in the module's
    /// docs for what it changes (nothing measured, where no flow is left out of the check).
    pub symmetry: bool,
    /// Skip the steps between strided links' transmissions where nothing happens (on by
    /// default): when every listed link is strided or holds only frozen flows' loads,
    /// none transmits or takes a landing until the next multiple of a stride, so the run
    /// goes straight there unless a release, a pause reaching its transmitter, a thaw or
    /// an ACK off its link's transmissions comes first (see "Steps between
    /// transmissions" in the module's docs). It changes no result: off, every such step
    /// is taken and does nothing.
    pub gap_skip: bool,
}

impl Default for FluidSimulator {
    fn default() -> Self {
        FluidSimulator {
            config: PacketConfig::default(),
            step: Self::DEFAULT_STEP,
            longest_link_step: None,
            calm_skip: true,
            symmetry: true,
            gap_skip: true,
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
        self.run_with_progress(graph, flows, progress)
            .map(|(report, _)| report)
    }
}

/// What one run of the fluid model used and did beyond its report.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct FluidRun {
    /// The time step it took: [`FluidSimulator::step`], or the shortest delay of a link
    /// the flows use if that is shorter.
    pub step: Picos,
    /// The longest step a link the flows use took (see
    /// [`FluidSimulator::longest_link_step`]): `step` unless some link was strided.
    pub longest_link_step: Picos,
    pub calm_skip: CalmSkipStats,
    /// Steps skipped between strided links' transmissions (see
    /// [`FluidSimulator::gap_skip`]; also in the report's skipped events).
    pub gap_skipped_steps: u64,
    /// The rotations symmetry reduction found, outermost first (see
    /// [`FluidSimulator::symmetry`]); empty when it found none.
    pub symmetry: Vec<SymmetryShift>,
    /// The flows stepped: the innermost quotient's (each standing for the product of the
    /// rotations' copies), or every flow without symmetry.
    pub simulated_flows: u64,
    /// Steps of a quotient run set aside because flows waiting for exempt ones came out of
    /// step with their copies (counted in the report's events too; see the `symmetry`
    /// module).
    pub retried_steps: u64,
}

/// What the calm skip did in one run of the fluid model.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct CalmSkipStats {
    /// Flows frozen (a flow may be frozen several times).
    pub freezes: u64,
    /// Frozen flows thawed before their time because another flow's bytes, a pause or a
    /// change of room reached one of their links.
    pub forced_thaws: u64,
    /// Steps skipped while every flow in flight was frozen (the report's skipped events).
    pub skipped_steps: u64,
}

impl FluidSimulator {
    /// The default time step (see [`FluidSimulator::step`]).
    pub const DEFAULT_STEP: Picos = Picos(500_000);

    /// The longest step of a link where a shorter link holds the step below the one asked
    /// for and [`FluidSimulator::longest_link_step`] is left to choose: a 1 us cable's
    /// delay, so such cables transmit once per delay. Measured against the packet model's
    /// reference on every fabric here with NVLink hosts (docs/benchmarks.md, 2026-12-07,
    /// night): per-flow errors as small (the GPT 350M ECMP step at 1,024 GPUs 1.15% mean
    /// and 32.0% p99 against 1.14% and 33.8%), ends within 0.2% (`small-ring` 0.18%
    /// against 0.04%), at 1.1 to 2.7 times the speed.
    pub const DEFAULT_LINK_STEP: Picos = Picos(1_000_000);

    /// Runs the model, reporting progress, and says which step it took, what the calm skip
    /// did and which symmetries it stepped one copy of.
    pub fn run_with_progress(
        &self,
        graph: &NetGraph,
        flows: &FlowSet,
        progress: &mut dyn FnMut(SimProgress),
    ) -> Result<(SimReport, FluidRun), SimError> {
        flows.check()?;
        let routes = Routes::compute(graph, flows)?;
        let cfg = self.config.sanitized();
        // No step longer than the shortest delay of a link the flows use (data or reverse
        // path): a link holds its bytes for whole steps (rounded down), and the rest is
        // added back to each completion, which must never fall before the step that
        // delivers it (its dependents cannot start in the past). Links no route takes
        // carry nothing, so their delays do not bound the step: a fabric's NVLink hops
        // (200 ns) would otherwise set the step of traffic that never crosses them.
        let shortest = routes
            .paths
            .iter()
            .map(|&l| graph.link(orrery_units::LinkId(l)).delay.0)
            .filter(|&d| d > 0)
            .min()
            .unwrap_or(u64::MAX);
        let step = self.step.0.clamp(1, shortest.max(1));
        let longest_link_step = self.longest_link_step.unwrap_or(if step < self.step.0 {
            Self::DEFAULT_LINK_STEP
        } else {
            Picos(step)
        });
        let longest_stride = (longest_link_step.0 / step).clamp(1, MAX_STRIDE) as usize;
        // Only the symmetry search reads the tie keys here (the fluid model orders a
        // port's queue pairs by their demands).
        let ties = if self.symmetry {
            super::host::tie_keys(graph, flows)
        } else {
            Vec::new()
        };
        // Flows of one packet may be left out of the symmetry check, as in the packet
        // model by default (see the `symmetry` module).
        let exempt_bytes = u64::from(cfg.mtu_payload);
        let out = simulate_reduced(
            graph,
            flows,
            routes,
            &ties,
            self.symmetry,
            exempt_bytes,
            progress,
            |flows, routes, copies, _ties, _levels, progress| {
                let mut fluid = Fluid::new(
                    &cfg,
                    step,
                    graph,
                    flows,
                    &routes,
                    copies,
                    self.calm_skip,
                    self.gap_skip,
                    longest_stride,
                );
                fluid.run(progress)?;
                let used_stride = routes
                    .paths
                    .iter()
                    .map(|&l| fluid.links[l as usize].stride)
                    .max()
                    .unwrap_or(1);
                let run = FluidRun {
                    step: Picos(step),
                    longest_link_step: Picos(step * used_stride),
                    calm_skip: CalmSkipStats {
                        freezes: fluid.freezes,
                        forced_thaws: fluid.forced_thaws,
                        skipped_steps: fluid.skipped_steps,
                    },
                    gap_skipped_steps: fluid.gap_skipped_steps,
                    symmetry: Vec::new(),
                    simulated_flows: flows.flows.len() as u64,
                    retried_steps: 0,
                };
                Ok(FluidOutput {
                    report: fluid.report(),
                    run,
                })
            },
        )?;
        Ok((out.report, out.run))
    }
}

/// A fluid run on its way through [`simulate_reduced`]: expanded level by level.
struct FluidOutput {
    report: SimReport,
    run: FluidRun,
}

impl ReducedRun for FluidOutput {
    fn events(&self) -> u64 {
        self.report.events
    }

    fn expand(self, q: &Quotient) -> Option<Self> {
        let mut run = self.run;
        run.symmetry.insert(0, q.shift);
        Some(FluidOutput {
            report: q.expand_report(self.report)?,
            run,
        })
    }

    fn add_retried_events(&mut self, events: u64) {
        self.report.events += events;
        self.run.retried_steps += events;
    }
}

/// Some bytes of one flow, on the hop `hop` of its data path.
#[derive(Debug, Clone, Copy)]
struct Part {
    flow: u32,
    hop: u32,
    wire: f64,
    /// When, in steps from the step it was sent at, the part's first and last bytes cross
    /// the link (its bytes spread evenly in between; up to the link's stride): what a
    /// completion is interpolated on, and the earliest a FIFO can pass the part on.
    begin: f64,
    end: f64,
}

/// One directed link: its transmitter (a NIC port or a switch egress port), its FIFO when
/// a switch sends on it, the bytes in flight on it, and its PFC state as an ingress.
///
/// In declared order (`repr(C)`), the fields a step reads of every listed link first, so
/// they share the fewest cache lines: a step touches hundreds of links for a few bytes
/// each.
#[derive(Debug)]
#[repr(C)]
struct Link {
    /// Steps per transmission: the link sends at steps that are multiples of it, each
    /// time for that many steps (1 unless [`FluidSimulator::longest_link_step`] lets it).
    stride: u64,
    /// If strided, the step it transmits at next: set at each transmission, and found
    /// again with a division where it fell behind (the link was not listed then).
    next_transmission: u64,
    /// Which slots of `ring` may hold parts: bit `slot % 64` (a ring of more than 64 slots
    /// keeps its bits once set). A step's landings test this bit rather than load each
    /// listed link's slot, which lies elsewhere in memory: on the ECMP GPT 350M step at
    /// 1,024 GPUs that load took 11% to 15% of the step function's own samples in perf.
    ring_bits: u64,
    /// Bytes in flight: `ring[k & (ring.len() - 1)]` lands at step `k` (a power of two of
    /// slots, more than the delay's steps, so a slot is found without a division).
    ring: Vec<Vec<Part>>,
    in_flight: usize,
    /// The flows whose first hop this is (a NIC port's queue pairs).
    qps: Vec<u32>,
    /// Control wire bytes for its next transmission (ACKs, with strict priority), and
    /// those on their way to it: `ctrl_ring[k & (ctrl_ring.len() - 1)]` reaches it at
    /// step `k` (a power of two of slots, more than the steps an ACK takes to reach it
    /// from any receiver), `ctrl_ahead` their sum.
    ctrl: f64,
    ctrl_ring: Vec<f64>,
    ctrl_ahead: f64,
    /// Wire bytes waiting in the egress FIFO (the FIFO itself is `segs` and `parts`).
    queued: f64,
    /// As an ingress of a switch: buffered bytes that came in by it, whether it has paused
    /// its transmitter, and how many pauses and resumes are on their way to the
    /// transmitter (in [`Fluid::pause_calendar`]).
    in_bytes: f64,
    pause_changes: u32,
    pause_sent: bool,
    paused: bool,
    /// Whether the link is in the active list.
    listed: bool,
    from_switch: bool,
    to_switch: bool,
    /// Whether it is in [`Fluid::frozen_links`], and in [`Fluid::pfc_links`].
    in_frozen_links: bool,
    in_pfc_links: bool,
    /// A NIC port whose one frozen flow was held to the port's room (less its control
    /// frames), not its rate: it stays frozen only while that room is the same.
    frozen_held: bool,
    to: u32,
    /// Frozen flows through this link: the wire bytes of data they send on it at every
    /// transmission (every step unless it is strided), the flows, and the wire bytes of
    /// ACKs their receivers send on it per transmission. A frozen flow's links all share
    /// its stride, so its grant is the same on each.
    frozen_flows: Vec<u32>,
    frozen_ctrl: f64,
    frozen: f64,
    /// Wire bytes it carries per step.
    cap: f64,
    delay_steps: usize,
    /// A strided NIC port's room left in its window that began at step `window_at`, for
    /// the queue pairs released inside that window.
    window_left: f64,
    window_at: u64,
    ecn: EcnThresholds,
    /// The egress FIFO: segments (parts count, wire bytes, the step they entered in) over
    /// the parts in entry order.
    segs: VecDeque<(u32, f64, u64)>,
    parts: VecDeque<Part>,
    /// Parts that entered the FIFO this step (one segment at the step's end).
    arriving: Vec<Part>,
    /// Steps from a pause or resume being sent to its reaching the transmitter: the
    /// pause frame's serialisation and the link's delay.
    pause_lag: u64,
    pauses: u64,
}

impl Link {
    /// Whether the link has anything of its own at a step: bytes landing, queued or to
    /// send, control frames, PFC state or buffered bytes. A listed link that has none is
    /// listed for frozen flows' loads only (a FIFO's dust segment aside, which
    /// [`Fluid::skip_gap`] asks about too), and a step leaves it as it was.
    fn busy(&self) -> bool {
        self.in_flight > 0
            || self.queued > DUST
            || !self.qps.is_empty()
            || self.ctrl > DUST
            || self.ctrl_ahead > DUST
            || self.pause_changes > 0
            || self.pause_sent
            || self.paused
            || self.in_bytes > DUST
    }
}

#[derive(Debug)]
struct FlowState {
    fwd: (u32, u32),
    rev: (u32, u32),
    /// Dependencies not finished yet, and the latest finish among those that are (side by
    /// side: a finish updates both for each of its dependents).
    deps: Waiting,
    delay: Picos,
    release: Option<Picos>,
    finish: Option<Picos>,
    /// Payload bytes, and the same with every packet's headers and framing.
    bytes: u64,
    wire_total: f64,
    wire_sent: f64,
    wire_delivered: f64,
    rp: ReactionPoint,
    /// CNPs on their way to the sender, by arrival time (its timers are the reaction
    /// point's own: `rp.pending_decrease()`, `rp.next_increase()`).
    cnps: VecDeque<Picos>,
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
    /// Calm-flow freezing: what its NIC port granted it at its last transmission, for how
    /// many transmissions in a row that was a whole one at its rate, the transmissions a
    /// grant takes to reach the receiver (with a margin), what reached the receiver in its
    /// last step of deliveries, and, while frozen, the step it was frozen at and the step
    /// it thaws at the latest.
    last_give: f64,
    same_gives: u32,
    pipeline_steps: u32,
    /// The stride every link of its data and reverse paths shares (1 where none is
    /// strided), or 0 where they differ: then it is never frozen (its grants would reach
    /// a link between that link's transmissions, which the frozen load, counted per
    /// transmission, does not describe).
    stride: u64,
    delivered_step: u64,
    delivered_in_step: f64,
    /// The ACK bytes its deliveries of `delivered_step` sent back, and the run of delivery
    /// steps before it, a transmission apart, whose ACKs were each `ack_run_total`, the
    /// last at `ack_run_end`: a flow is frozen only where the ACKs of its deliveries still
    /// in flight on its reverse path are each one grant's, as freezing takes them to be.
    acked_in_step: f64,
    ack_run: u32,
    ack_run_total: f64,
    ack_run_end: u64,
    /// The earlier delivery steps whose ACKs are still in flight on its reverse path when
    /// it delivers (its delays but the last link's, in transmissions, less one).
    acks_in_flight: u32,
    frozen: Option<(u64, u64)>,
}

/// A flow's unfinished dependencies.
#[derive(Debug, Clone, Copy)]
struct Waiting {
    left: u32,
    latest: Picos,
}

struct Fluid<'a> {
    cfg: &'a PacketConfig,
    dt: u64,
    links: Vec<Link>,
    paths: Vec<u32>,
    flows: Vec<FlowState>,
    dependents: Vec<Vec<u32>>,
    /// Per switch node: shared-pool capacity and use (buffered bytes), and how many alike
    /// switches it stands for in a symmetry quotient (each byte it holds counts that many
    /// times against its pool, as the copies' bytes would; 1 without symmetry).
    shared_cap: Vec<f64>,
    shared_used: Vec<f64>,
    buffer_copies: Vec<f64>,
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
    /// What each part a FIFO serves frees of its ingress's buffer, and what a link sends
    /// in one transmission (kept between calls, so a step allocates nothing).
    freed_scratch: Vec<f64>,
    sent_scratch: Vec<Part>,
    /// The links whose `arriving` took parts this step, and the pauses (true) and resumes
    /// on their way, by (step they reach the transmitter at, link): what a step visits
    /// instead of every listed link. A link sends at most one per step, so each key is
    /// one change.
    arrived: Vec<u32>,
    pause_calendar: std::collections::BTreeMap<(u64, u32), bool>,
    /// The switch ingresses that may pause or resume: those holding shared bytes or with a
    /// pause sent (some may have neither left: dropped at the next PFC pass).
    pfc_links: Vec<u32>,
    /// Queue pairs released this step inside their strided port's window, as (port, flow),
    /// and a scratch list of one port's (kept between steps so a step allocates nothing).
    late_joins: Vec<(u32, u32)>,
    late_flows: Vec<u32>,
    /// Calm-flow freezing: whether it is on, the flows that became candidates this step,
    /// the frozen flows' latest thaws as (step, flow) (one each: none frozen when it is
    /// empty), and what it did: freezes, thaws forced by something reaching a frozen
    /// flow's link, and steps skipped while flows were frozen.
    calm_skip: bool,
    candidates: Vec<u32>,
    /// The links frozen flows cross (some may have none left: dropped when next tested).
    frozen_links: Vec<u32>,
    thaws: std::collections::BTreeSet<(u64, u32)>,
    freezes: u64,
    forced_thaws: u64,
    skipped_steps: u64,
    /// Skipping the steps between strided links' transmissions ([`Fluid::skip_gap`]):
    /// whether it is on, the strides above one of the links the flows use, the listed
    /// links that transmit every step (while one of them is busy, every step may do
    /// something), the latest step an ACK reaches a strided link at between its
    /// transmissions (until then no step is skipped), and the steps skipped.
    gap_skip: bool,
    strides: Vec<u64>,
    every_step_links: Vec<u32>,
    acks_off_grid_until: u64,
    gap_skipped_steps: u64,
}

impl<'a> Fluid<'a> {
    /// The model of `flows` on `routes` (a symmetry quotient's, with its switches'
    /// `buffer_copies`, as [`super::engine::Engine::with_routes`] takes them).
    #[allow(clippy::too_many_arguments)]
    fn new(
        cfg: &'a PacketConfig,
        dt: u64,
        graph: &NetGraph,
        flows: &FlowSet,
        routes: &Routes,
        buffer_copies: &[u64],
        calm_skip: bool,
        gap_skip: bool,
        longest_stride: usize,
    ) -> Fluid<'a> {
        let frame = (u64::from(cfg.mtu_payload) + u64::from(cfg.header_bytes)) as f64;
        let wire_per_packet = cfg.data_wire_bytes() as f64;
        let ack_wire = (u64::from(cfg.ack_bytes) + u64::from(cfg.framing_bytes)) as f64;
        let pause_frame = (u64::from(cfg.pfc_frame_bytes) + u64::from(cfg.framing_bytes)) as f64;
        let dt_secs = dt as f64 / PICOS_PER_SEC;
        let mut links: Vec<Link> = graph
            .links()
            .iter()
            .map(|l| {
                let delay_steps = ((l.delay.0 / dt) as usize).max(1);
                let to_switch = graph.kind(l.to).is_switch();
                let stride = stride_for(delay_steps, longest_stride);
                Link {
                    cap: on_grid(l.bandwidth.0 * dt_secs),
                    delay_steps,
                    stride,
                    next_transmission: 0,
                    window_left: 0.0,
                    window_at: u64::MAX,
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
                    ring_bits: 0,
                    in_flight: 0,
                    qps: Vec::new(),
                    ctrl: 0.0,
                    ctrl_ring: Vec::new(),
                    ctrl_ahead: 0.0,
                    in_bytes: 0.0,
                    pause_sent: false,
                    paused: false,
                    pause_changes: 0,
                    pause_lag: (delay_steps as u64
                        + (pause_frame / l.bandwidth.0 / dt_secs).ceil() as u64)
                        .max(1),
                    pauses: 0,
                    listed: false,
                    frozen: 0.0,
                    frozen_flows: Vec::new(),
                    frozen_ctrl: 0.0,
                    frozen_held: false,
                    in_frozen_links: false,
                    in_pfc_links: false,
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
            let stride = links[path[0] as usize].stride;
            let stride = if path
                .iter()
                .chain(rpath)
                .all(|&l| links[l as usize].stride == stride)
            {
                stride
            } else {
                0
            };
            // In its port's transmissions (one per `stride` steps).
            let pipeline_steps = path
                .iter()
                .map(|&l| (links[l as usize].delay_steps as u64 / stride.max(1)) as u32 + 1)
                .sum::<u32>()
                + 2;
            states.push(FlowState {
                fwd,
                rev,
                deps: Waiting {
                    left: f.deps.len() as u32,
                    latest: Picos::ZERO,
                },
                delay: f.delay,
                release: None,
                finish: None,
                bytes,
                wire_total,
                wire_sent: 0.0,
                wire_delivered: 0.0,
                rp: ReactionPoint::new(line),
                cnps: VecDeque::new(),
                last_cnp: None,
                marks: 0.0,
                rest_delay,
                rev_delay,
                finish_extra: extra,
                last_give: 0.0,
                same_gives: 0,
                pipeline_steps,
                stride,
                delivered_step: u64::MAX,
                delivered_in_step: 0.0,
                acked_in_step: 0.0,
                ack_run: 0,
                ack_run_total: 0.0,
                ack_run_end: 0,
                acks_in_flight: 0,
                frozen: None,
            });
        }
        // Each link's ACK ring spans the longest an ACK takes to reach it from a receiver.
        // A flow's ACKs reach its reverse path's last link after every other link's delay:
        // the deliveries of the transmissions before one whose ACKs are then on their way
        // are its `acks_in_flight`.
        let mut ack_steps = vec![0usize; links.len()];
        for s in &mut states {
            let mut after = 0;
            for &l in &routes.paths[s.rev.0 as usize..(s.rev.0 + s.rev.1) as usize] {
                ack_steps[l as usize] = ack_steps[l as usize].max(after);
                let stride = s.stride.max(1);
                s.acks_in_flight = ((after as u64).saturating_sub(stride) / stride) as u32;
                after += links[l as usize].delay_steps;
            }
        }
        for (link, steps) in links.iter_mut().zip(ack_steps) {
            if steps > 0 {
                link.ctrl_ring = vec![0.0; (steps + 1).next_power_of_two()];
            }
        }
        let mut releases = std::collections::BTreeSet::new();
        for (i, s) in states.iter_mut().enumerate() {
            if s.deps.left == 0 {
                s.release = Some(s.delay);
                releases.insert((s.delay, i as u32));
            }
        }
        let unfinished = states.len();
        let mut strides: Vec<u64> = routes
            .paths
            .iter()
            .map(|&l| links[l as usize].stride)
            .filter(|&s| s > 1)
            .collect();
        strides.sort_unstable();
        strides.dedup();
        Fluid {
            cfg,
            dt,
            links,
            paths: routes.paths.clone(),
            flows: states,
            dependents,
            shared_cap,
            shared_used: vec![0.0; n_nodes],
            buffer_copies: buffer_copies.iter().map(|&c| c.max(1) as f64).collect(),
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
            freed_scratch: Vec::new(),
            sent_scratch: Vec::new(),
            arrived: Vec::new(),
            pause_calendar: std::collections::BTreeMap::new(),
            pfc_links: Vec::new(),
            late_joins: Vec::new(),
            late_flows: Vec::new(),
            calm_skip,
            candidates: Vec::new(),
            frozen_links: Vec::new(),
            thaws: std::collections::BTreeSet::new(),
            freezes: 0,
            forced_thaws: 0,
            skipped_steps: 0,
            gap_skip,
            strides,
            every_step_links: Vec::new(),
            acks_off_grid_until: 0,
            gap_skipped_steps: 0,
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
            if link.stride == 1 {
                self.every_step_links.push(l);
            }
            self.active.push(l);
        }
    }

    fn run(&mut self, progress: &mut dyn FnMut(SimProgress)) -> Result<(), SimError> {
        let total = self.flows.len();
        let mut k: u64 = 0;
        while self.unfinished > 0 {
            // Nothing in flight, queued or sending but frozen flows: skip to the step of the
            // next release or thaw.
            if self.senders == 0 && self.in_flight_total == 0 && self.nothing_queued() {
                let release = self.releases.first().map(|&(t, _)| t.0 / self.dt);
                let thaw = self.thaws.first().map(|&(at, _)| at);
                let Some(next) = release.into_iter().chain(thaw).min() else {
                    break;
                };
                if !self.thaws.is_empty() {
                    self.skipped_steps += next.saturating_sub(k);
                }
                if next > k {
                    self.skip_windows(k, next);
                }
                k = k.max(next);
            }
            if self.gap_skip {
                k = self.skip_gap(k);
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

    /// Steps `from..to` are skipped with only frozen flows sending: a strided NIC port
    /// holding frozen flows whose window containing `to` began in them would have served
    /// them at its start, leaving what a queue pair released inside it may use (see
    /// [`Fluid::serve_late_joins`]). Nothing else was there: no queue pair sends, and its
    /// control frames are none (ACK loads are on the grid, so at most dust means zero).
    fn skip_windows(&mut self, from: u64, to: u64) {
        for i in 0..self.frozen_links.len() {
            let l = self.frozen_links[i];
            let link = &self.links[l as usize];
            if link.from_switch || link.stride == 1 || link.frozen_flows.is_empty() {
                continue;
            }
            let window = to - to % link.stride;
            if window >= from && window < to {
                self.open_window(l, window, self.room(l));
            }
        }
    }

    /// The step to take next instead of `k` (the step after the last one taken): the
    /// next at which a strided link transmits or takes a landing, where every listed link
    /// is strided or holds only frozen flows' loads and nothing else comes first. Each step skipped would have done nothing
    /// (see "Steps between transmissions" in the module's docs); the ACKs that reach links
    /// by the step taken are put on them as the last step skipped would have.
    fn skip_gap(&mut self, k: u64) -> u64 {
        // A busy link that transmits every step, the common case while NVLink carries
        // bytes, ends the search first: it needs no look at the calendars.
        if self.acks_off_grid_until > k
            || self
                .every_step_links
                .iter()
                .any(|&l| self.links[l as usize].busy() || !self.links[l as usize].segs.is_empty())
        {
            return k;
        }
        let Some(mut to) = self.strides.iter().map(|&s| k.next_multiple_of(s)).min() else {
            return k;
        };
        if let Some(&(at, _)) = self.releases.first() {
            to = to.min(at.0 / self.dt);
        }
        if let Some((&(at, _), _)) = self.pause_calendar.first_key_value() {
            to = to.min(at);
        }
        if let Some(&(at, _)) = self.thaws.first() {
            to = to.min(at);
        }
        if to <= k {
            return k;
        }
        // What a skipped step would still decide with the state as it is: a thaw where
        // something reached a frozen flow's link (no later than the first step skipped,
        // as neither FIFOs, rooms nor demands change in between), a pause or a resume.
        let t = Picos(k * self.dt);
        if !self.thaws.is_empty()
            && (0..self.frozen_links.len())
                .any(|i| self.reached(self.frozen_links[i] as usize, k, t))
        {
            return k;
        }
        if self.cfg.pfc
            && (0..self.pfc_links.len())
                .any(|i| self.pfc_change(self.pfc_links[i] as usize).is_some())
        {
            return k;
        }
        self.take_ctrl(to - 1);
        self.gap_skipped_steps += to - k;
        to
    }

    fn nothing_queued(&self) -> bool {
        self.active.iter().all(|&l| {
            let link = &self.links[l as usize];
            link.queued <= DUST && link.ctrl <= DUST && link.ctrl_ahead <= DUST
        })
    }

    /// One step `[k dt, (k + 1) dt)`.
    fn step(&mut self, k: u64) {
        let (t, next) = (Picos(k * self.dt), Picos((k + 1) * self.dt));
        // Rate control events up to the step's start, in time order per flow, for the
        // ports that transmit in it. A strided port's flows are driven at its next
        // transmission instead: each event is applied at its own time whenever the call
        // comes, and their rates are read only when the port sends (or where a thaw is
        // tested, which changes nothing it decides).
        if self.cfg.dcqcn {
            for i in 0..self.active.len() {
                let l = self.active[i];
                if !self.transmits(l, k) {
                    continue;
                }
                for q in 0..self.links[l as usize].qps.len() {
                    let f = self.links[l as usize].qps[q];
                    self.drive_rate(f, t);
                }
            }
        }
        // Pauses and resumes that reach their transmitters (each link's in the order they
        // were sent).
        while let Some((&(at, l), &paused)) = self.pause_calendar.first_key_value() {
            if at > k {
                break;
            }
            self.pause_calendar.pop_first();
            let link = &mut self.links[l as usize];
            link.paused = paused;
            link.pause_changes -= 1;
        }
        // Bytes landing this step: into the next switch's egress FIFO, or delivered (a
        // completion releases its dependents at once, so they may send in this step).
        for i in 0..self.active.len() {
            let l = self.active[i];
            let link = &mut self.links[l as usize];
            let slot = (k as usize) & (link.ring.len() - 1);
            if link.ring_bits & slot_bit(slot) == 0 {
                continue;
            }
            if link.ring.len() <= 64 {
                link.ring_bits &= !slot_bit(slot);
            }
            if link.ring[slot].is_empty() {
                continue;
            }
            let mut landing = std::mem::take(&mut self.links[l as usize].ring[slot]);
            self.links[l as usize].in_flight -= landing.len();
            self.in_flight_total -= landing.len();
            if self.links[l as usize].to_switch {
                let mut added = 0.0;
                for p in &landing {
                    let out = self.path(p.flow)[p.hop as usize + 1];
                    let next = &mut self.links[out as usize];
                    if next.arriving.is_empty() {
                        self.arrived.push(out);
                    }
                    next.arriving.push(Part {
                        hop: p.hop + 1,
                        ..*p
                    });
                    added += on_grid(p.wire * self.buffered_per_wire);
                    self.list(out);
                }
                self.ingress_add(l, added);
            } else {
                for p in &landing {
                    self.deliver(p, k);
                }
            }
            landing.clear();
            self.links[l as usize].ring[slot] = landing;
        }
        // Releases within the step join their NIC ports.
        let mut late = std::mem::take(&mut self.late_joins);
        late.clear();
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
            // Inside a strided port's window, which it has served already: it sends from
            // its release in what the window has left (below).
            let stride = self.links[first as usize].stride;
            if stride > 1 && !k.is_multiple_of(stride) {
                late.push((first, f));
            }
        }
        // Each FIFO's arrivals of the step become one segment, in the order of their flows:
        // bytes of one step count as arriving together, and an order of their own keeps
        // the result from depending on the order links are visited in (which freezing
        // changes). Only the links that took arrivals are visited.
        for i in 0..self.arrived.len() {
            let link = &mut self.links[self.arrived[i] as usize];
            link.arriving.sort_by_key(|p| p.flow);
            let mut sum = 0.0;
            let n = link.arriving.len() as u32;
            for p in link.arriving.drain(..) {
                sum += p.wire;
                link.parts.push_back(p);
            }
            link.segs.push_back((n, sum, k));
            link.queued += sum;
        }
        self.arrived.clear();
        if !self.thaws.is_empty() {
            self.thaw_where_reached(k);
        }
        // Every link due transmits (each step, or each `stride` steps for as many): control
        // frames first, then data unless paused. A frozen flow's bytes take their share of
        // the link as if they were there. A strided link's control frames are those of all
        // the steps since its last transmission.
        let mut sent = std::mem::take(&mut self.sent_scratch);
        for i in 0..self.active.len() {
            let l = self.active[i];
            if !self.transmits(l, k) {
                continue;
            }
            let link = &self.links[l as usize];
            let stride = link.stride;
            let (room, frozen) = self.room(l);
            let (paused, from_switch) = (link.paused, link.from_switch);
            if stride > 1 {
                if !from_switch {
                    // Less what this transmission sends, below.
                    self.open_window(l, k, (room, frozen));
                }
                let link = &mut self.links[l as usize];
                link.ctrl = 0.0;
                // Its next, found without a division.
                link.next_transmission = k + stride;
            }
            if paused || room - frozen <= 0.0 {
                continue;
            }
            sent.clear();
            if from_switch {
                self.serve_fifo(l, room, frozen, k, &mut sent);
            } else {
                self.serve_nic(l, room - frozen, t, None, &mut sent);
            }
            if sent.is_empty() {
                continue;
            }
            if from_switch && self.cfg.dcqcn {
                self.mark(l, &sent, t);
            }
            if stride > 1 {
                let used = in_steps(&mut sent, stride as f64);
                let link = &mut self.links[l as usize];
                link.window_left = (link.window_left - used).max(0.0);
            }
            self.launch(l, k, &sent);
        }
        if !late.is_empty() {
            self.serve_late_joins(k, &mut late, &mut sent);
        }
        self.late_joins = late;
        self.sent_scratch = sent;
        self.pfc(k);
        self.take_ctrl(k);
        let mut candidates = std::mem::take(&mut self.candidates);
        for &c in &candidates {
            self.try_freeze(c, k);
        }
        candidates.clear();
        self.candidates = candidates;
        // Links with nothing left leave the active list.
        let links = &mut self.links;
        self.active.retain(|&l| {
            let link = &mut links[l as usize];
            // A frozen flow's links stay on the list as its bytes in flight would keep
            // them: the list's order decides the order in which a step's marks and buffer
            // changes add up, and it must not depend on freezing.
            let keep = link.busy() || !link.frozen_flows.is_empty() || link.frozen_ctrl > 0.0;
            if !keep {
                link.listed = false;
            }
            keep
        });
        self.every_step_links.retain(|&l| links[l as usize].listed);
    }

    /// Control frames at the end of step `k`: the ACKs that reach each listed link by the
    /// next step.
    fn take_ctrl(&mut self, k: u64) {
        for i in 0..self.active.len() {
            let link = &mut self.links[self.active[i] as usize];
            let slot = (k as usize + 1) & (link.ctrl_ring.len().max(1) - 1);
            let due = link.ctrl_ring.get_mut(slot).map_or(0.0, std::mem::take);
            link.ctrl_ahead -= due;
            if link.stride > 1 {
                // Until its next transmission.
                link.ctrl += due;
            } else {
                link.ctrl = due;
            }
        }
    }

    /// Whether link `l` transmits at step `k`: every step, or at multiples of its stride.
    /// Asked of every listed link at every step, so a strided link keeps its next
    /// transmission and divides only where that fell behind.
    fn transmits(&mut self, l: u32, k: u64) -> bool {
        let link = &mut self.links[l as usize];
        if link.stride == 1 {
            return true;
        }
        if link.next_transmission < k {
            link.next_transmission = k.next_multiple_of(link.stride);
        }
        link.next_transmission == k
    }

    /// Opens strided NIC port `l`'s window at step `window`, its room for the window and
    /// the frozen flows' share of it being `room` and `frozen`: what its queue pairs
    /// released inside it may use, before what the window's transmission sends.
    fn open_window(&mut self, l: u32, window: u64, (room, frozen): (f64, f64)) {
        let link = &mut self.links[l as usize];
        link.window_at = window;
        link.window_left = if link.paused {
            0.0
        } else {
            (room - frozen).max(0.0)
        };
    }

    /// Link `l`'s room for one transmission (its stride of steps) after its control frames
    /// and the frozen flows' ACKs, and the frozen flows' data in it.
    fn room(&self, l: u32) -> (f64, f64) {
        let link = &self.links[l as usize];
        let room = (link.stride as f64 * link.cap - link.ctrl - link.frozen_ctrl).max(0.0);
        (room, link.frozen)
    }

    /// Puts the parts link `l` sent at step `k` in flight, to land its delay later.
    fn launch(&mut self, l: u32, k: u64, sent: &[Part]) {
        let link = &mut self.links[l as usize];
        let land = (k as usize + link.delay_steps) & (link.ring.len() - 1);
        link.in_flight += sent.len();
        self.in_flight_total += sent.len();
        link.ring_bits |= slot_bit(land);
        link.ring[land].extend_from_slice(sent);
    }

    /// Queue pairs released at step `k` inside the window of their strided NIC port, which
    /// that port served at the window's start: each sends from its release in what the
    /// window has left (sharing it by water-filling with the others released in it, not
    /// with the queue pairs already served), its bytes launched with the window's, so
    /// they land where the port's next hop takes them. Without this a flow would wait for
    /// the next window, up to a stride of steps: with 1 us strides on the ECMP GPT 350M
    /// step at 512 GPUs its flows between hosts were 3.2% off the reference on average
    /// instead of 1.2%.
    fn serve_late_joins(&mut self, k: u64, late: &mut [(u32, u32)], sent: &mut Vec<Part>) {
        late.sort_unstable();
        let mut flows = std::mem::take(&mut self.late_flows);
        for group in late.chunk_by(|a, b| a.0 == b.0) {
            let l = group[0].0;
            let link = &self.links[l as usize];
            if link.paused {
                continue;
            }
            let stride = link.stride;
            let window = k - k % stride;
            let room = if link.window_at == window {
                link.window_left
            } else {
                // Not served at the window's start: nothing to send then.
                let (room, frozen) = self.room(l);
                (room - frozen).max(0.0)
            };
            if room <= 0.0 {
                continue;
            }
            flows.clear();
            flows.extend(group.iter().map(|&(_, f)| f));
            sent.clear();
            self.serve_nic(l, room, Picos(window * self.dt), Some(&flows), sent);
            let used = in_steps(sent, stride as f64);
            let link = &mut self.links[l as usize];
            link.window_left = (room - used).max(0.0);
            link.window_at = window;
            self.launch(l, window, sent);
        }
        self.late_flows = flows;
    }

    /// Applies flow `f`'s CNP arrivals, decrease ticks and increase timers up to `t`, in
    /// time order (a tick before a CNP of the same instant, as the packet model files them).
    fn drive_rate(&mut self, f: u32, t: Picos) {
        let p = &self.cfg.dcqcn_params;
        let fl = &mut self.flows[f as usize];
        loop {
            let cnp = fl.cnps.front().copied();
            let (decrease, increase) = (fl.rp.pending_decrease(), fl.rp.next_increase());
            let Some(at) = [decrease, increase, cnp].into_iter().flatten().min() else {
                break;
            };
            if at > t {
                break;
            }
            // What each call schedules is the reaction point's own state, read above.
            if Some(at) == decrease {
                fl.rp.on_decrease_tick(at, p);
            } else if Some(at) == increase {
                fl.rp.on_increase_timer(at, p);
            } else {
                fl.cnps.pop_front();
                fl.rp.on_cnp(at, p);
            }
        }
    }

    /// Serves up to `room` wire bytes of link `l`'s FIFO in step `k`, head first, into
    /// `sent`; the bytes leave their ingress ports' accounting.
    ///
    /// When each part crosses the link within the step: bytes queued before the step go
    /// back to back from its start; the step's own arrivals (its last segment) go out
    /// together after them, interleaved as they arrived, no earlier than they arrived.
    ///
    /// `frozen` wire bytes of frozen flows cross the link too this step: they arrived in it
    /// and leave with its last segment (the link is calm: nothing older is queued, see
    /// [`Fluid::thaw_where_reached`]), so they lengthen that segment's span.
    fn serve_fifo(&mut self, l: u32, room: f64, frozen: f64, k: u64, sent: &mut Vec<Part>) {
        let per_wire = self.buffered_per_wire;
        let mut freed = std::mem::take(&mut self.freed_scratch);
        freed.clear();
        let link = &mut self.links[l as usize];
        let mut left = (room - frozen).min(link.queued);
        let mut clock = 0.0f64;
        while left > DUST {
            let Some(&(n, total, born)) = link.segs.front() else {
                break;
            };
            // A segment all but dust of which fits goes whole: the running sum `queued`
            // drifts from its segments' by float dust, and a dust remainder would stand
            // in the queue as an older segment, step after step.
            let take = if total <= left + DUST { total } else { left };
            let share = take / total;
            let fresh = born == k;
            let span = if fresh { take + frozen } else { take };
            let (seg_begin, seg_end) = (clock, clock + span / room);
            for p in link.parts.iter_mut().take(n as usize) {
                let wire = p.wire * share;
                let (begin, end) = if fresh {
                    // In this link's step (a part from a link with a longer stride may
                    // reach past it: counted as arriving by its end).
                    let sf = link.stride as f64;
                    (
                        seg_begin.max(p.begin / sf).min(1.0),
                        seg_end.max(p.end / sf).min(1.0),
                    )
                } else {
                    let b = clock;
                    clock += wire / room;
                    (b, clock.min(1.0))
                };
                // What the part frees of its ingress's buffer, on the grid: what it holds
                // before less what it holds after, so the pieces of a part add up to what
                // its landing took, whatever they are.
                let held = on_grid(p.wire * per_wire);
                p.wire -= wire;
                let still = if share >= 1.0 {
                    0.0
                } else {
                    on_grid(p.wire * per_wire)
                };
                freed.push(held - still);
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
        for (p, &bytes) in sent.iter().zip(&freed) {
            let ingress = self.path(p.flow)[p.hop as usize - 1];
            self.ingress_add(ingress, -bytes);
        }
        self.freed_scratch = freed;
    }

    /// Serves NIC port `l`'s queue pairs (or `only` those): each may send its rate's worth
    /// of the port's step from `t` (from its release, if that falls within it) and no more
    /// than it has left; they share the port's `room` by water-filling.
    fn serve_nic(
        &mut self,
        l: u32,
        room: f64,
        t: Picos,
        only: Option<&[u32]>,
        sent: &mut Vec<Part>,
    ) {
        let mut want = std::mem::take(&mut self.nic_scratch);
        want.clear();
        let qps = std::mem::take(&mut self.links[l as usize].qps);
        for &f in only.unwrap_or(&qps) {
            let (demand, begin, full) = self.nic_demand(f, t);
            want.push((demand, f, begin, full));
        }
        self.links[l as usize].qps = qps;
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
            let fl = &mut self.flows[f as usize];
            // A whole step at its rate, or all the port's room, as the step before: calm at
            // its sender so far.
            if give > 0.0 && begin == 0.0 && give == fl.last_give {
                fl.same_gives += 1;
                if self.calm_skip && fl.stride != 0 && fl.same_gives == fl.pipeline_steps {
                    self.candidates.push(f);
                }
            } else {
                fl.same_gives = 0;
            }
            fl.last_give = give;
            if give <= 0.0 {
                continue;
            }
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

    /// What flow `f` asks of its NIC port in the step from `t`: (wire bytes, when within
    /// the step it starts, as a fraction, and a whole step's worth at its rate from then).
    fn nic_demand(&self, f: u32, t: Picos) -> (f64, f64, f64) {
        let fl = &self.flows[f as usize];
        // The port's step: `stride` steps from `t`.
        let window = self.dt * self.links[self.path(f)[0] as usize].stride;
        let from = fl.release.map_or(t, |r| r.max(t));
        let begin = ((from.0 - t.0) as f64 / window as f64).min(1.0);
        let rate = if self.cfg.dcqcn {
            fl.rp.rate
        } else {
            fl.rp.line
        };
        let full = rate * (window as f64 / PICOS_PER_SEC) * (1.0 - begin);
        let demand = full.min(fl.wire_total - fl.wire_sent).max(0.0);
        (demand, begin, full)
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
        let window = self.dt * link.stride;
        let dt = window as f64;
        for p in sent {
            let fl = &mut self.flows[p.flow as usize];
            let rest = fl.rest_delay[p.hop as usize].0;
            // The part leaves the queue spread over the step; its marked packets reach the
            // receiver `rest` later, where they count once the receiver may send again.
            let eligible = fl
                .last_cnp
                .map_or(0, |c| (c.0 + interval).saturating_sub(rest));
            let from = eligible.max(t.0);
            if from >= t.0 + window {
                continue;
            }
            let per_ps = p.wire / self.wire_per_packet * prob / dt;
            let avail = per_ps * (t.0 + window - from) as f64;
            if fl.marks + avail < FIRST_MARK {
                fl.marks += avail;
                continue;
            }
            // The marked packet that completes the threshold: the CNP leaves the receiver
            // when it arrives, within the step.
            let crossing = from + ((FIRST_MARK - fl.marks) / per_ps).round() as u64;
            let arrive = Picos(crossing.min(t.0 + window) + rest);
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
        // An integer multiple of grid values stays on the grid: exact in any order.
        self.shared_used[link.to as usize] +=
            (after - before) * self.buffer_copies[link.to as usize];
        if after > 0.0 && !link.in_pfc_links {
            link.in_pfc_links = true;
            self.pfc_links.push(l);
        }
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
        // Only an ingress holding shared bytes can pass the threshold, and only one that
        // has paused can resume: the others are left out.
        let links = &mut self.links;
        self.pfc_links.retain(|&l| {
            let link = &mut links[l as usize];
            link.in_pfc_links = link.in_bytes > reserve || link.pause_sent;
            link.in_pfc_links
        });
        for i in 0..self.pfc_links.len() {
            let l = self.pfc_links[i] as usize;
            let Some(pause) = self.pfc_change(l) else {
                continue;
            };
            let link = &mut self.links[l];
            link.pause_sent = pause;
            link.pauses += u64::from(pause);
            link.pause_changes += 1;
            let earlier = self
                .pause_calendar
                .insert((k + link.pause_lag, l as u32), pause);
            debug_assert!(earlier.is_none());
        }
    }

    /// What PFC sends from ingress `l` now: a pause (`true`) when its shared use passes
    /// the dynamic threshold, a resume when it is `pfc_resume_offset` under it or zero.
    fn pfc_change(&self, l: usize) -> Option<bool> {
        let link = &self.links[l];
        let sw = link.to as usize;
        let thr = self.cfg.pfc_alpha * (self.shared_cap[sw] - self.shared_used[sw]).max(0.0);
        let shared = (link.in_bytes - self.cfg.pfc_reserve as f64).max(0.0);
        if !link.pause_sent && shared > thr {
            Some(true)
        } else if link.pause_sent
            && (shared <= DUST || shared + self.cfg.pfc_resume_offset as f64 <= thr)
        {
            Some(false)
        } else {
            None
        }
    }

    /// Part `p` reached its flow's receiver in step `step`: its ACKs load the receiver's
    /// link in this step and each further link of the reverse path as they reach it, and
    /// the flow's last byte finishes it, at that byte's place within the part's span of
    /// the step.
    fn deliver(&mut self, p: &Part, step: u64) {
        let t = Picos(step * self.dt);
        let (f, wire) = (p.flow, p.wire);
        let ack = on_grid(wire * self.ack_per_wire);
        self.schedule_acks(f, step, ack);
        let fl = &mut self.flows[f as usize];
        if fl.delivered_step == step {
            fl.delivered_in_step += wire;
            fl.acked_in_step += ack;
        } else {
            if fl.delivered_step != u64::MAX {
                // The step before is complete: it extends the run of equal ACKs, or
                // starts one.
                let stride = fl.stride.max(1);
                if fl.ack_run > 0
                    && fl.ack_run_end + stride == fl.delivered_step
                    && fl.acked_in_step == fl.ack_run_total
                {
                    fl.ack_run += 1;
                } else {
                    fl.ack_run = 1;
                    fl.ack_run_total = fl.acked_in_step;
                }
                fl.ack_run_end = fl.delivered_step;
            }
            fl.delivered_step = step;
            fl.delivered_in_step = wire;
            fl.acked_in_step = ack;
        }
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

    /// Puts the ACKs of flow `f`'s bytes delivered in step `step`, `ack` wire bytes, on
    /// each link of its reverse path when they reach it: the receiver's own link in this
    /// step (it has not transmitted yet: deliveries come first), each further one after
    /// the delays of the links before it, as the packet model's ACKs go hop by hop.
    fn schedule_acks(&mut self, f: u32, step: u64, ack: f64) {
        let (a, n) = self.flows[f as usize].rev;
        let mut after = 0usize;
        for h in a..a + n {
            let l = self.paths[h as usize];
            let link = &mut self.links[l as usize];
            if after == 0 {
                link.ctrl += ack;
            } else {
                let due = step as usize + after;
                let slot = due & (link.ctrl_ring.len() - 1);
                link.ctrl_ring[slot] += ack;
                link.ctrl_ahead += ack;
                // Between the link's transmissions (a reverse path of mixed strides): no
                // step is skipped until it has come.
                if link.stride > 1 && !(due as u64).is_multiple_of(link.stride) {
                    self.acks_off_grid_until = self.acks_off_grid_until.max(due as u64);
                }
            }
            after += link.delay_steps;
            self.list(l);
        }
    }

    fn finish(&mut self, f: u32, at: Picos) {
        self.flows[f as usize].finish = Some(at);
        self.unfinished -= 1;
        for k in 0..self.dependents[f as usize].len() {
            let d = self.dependents[f as usize][k] as usize;
            let dep = &mut self.flows[d];
            let waiting = &mut dep.deps;
            waiting.left -= 1;
            // The last finish, not the last processed: two finishes within one step are
            // processed in the order their bytes landed, not in the order of their times.
            waiting.latest = waiting.latest.max(at);
            if waiting.left == 0 {
                let r = Picos(waiting.latest.0.saturating_add(dep.delay.0));
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
            accel: crate::sim::AccelCounts {
                skipped_events: self.skipped_steps + self.gap_skipped_steps,
                ..Default::default()
            },
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::topology::{Link as GraphLink, NodeKind};
    use orrery_units::{Bandwidth, Bytes};

    #[test]
    fn a_link_strides_by_the_longest_divisor_of_its_delay_within_the_bound() {
        // (delay in steps, longest stride) -> stride
        for ((delay, longest), stride) in [
            ((5, 5), 5),
            ((10, 5), 5),
            ((6, 5), 3),
            ((7, 5), 1),
            ((3, 5), 3),
            ((1, 5), 1),
            ((4, 1), 1),
        ] {
            assert_eq!(
                stride_for(delay, longest),
                stride,
                "{delay} steps, {longest}"
            );
        }
    }

    #[test]
    fn loads_on_the_grid_add_up_exactly_in_any_order() {
        assert_eq!(on_grid(1.0 / 3.0), 341.0 / GRID);
        let terms: Vec<f64> = (1..200).map(|i| on_grid(i as f64 * 0.731)).collect();
        let forward: f64 = terms.iter().sum();
        let backward: f64 = terms.iter().rev().sum();
        assert_eq!(forward.to_bits(), backward.to_bits());
    }

    /// A switch with three endpoints: 0 and 1 on 1 us cables, 2 on a 500 ns one, at 500 ns
    /// steps with strides of up to two: the cables transmit at even steps, 2's links every
    /// step. One 10 MB flow 1 -> 0.
    fn two_strides() -> (NetGraph, FlowSet) {
        let bw = Bandwidth::from_gbits_per_sec(100.0);
        let mut links = Vec::new();
        for e in 0..3u32 {
            let delay = if e == 2 {
                Picos::from_nanos(500)
            } else {
                Picos::from_micros(1)
            };
            let (end, sw) = (orrery_units::NodeId(e), orrery_units::NodeId(3));
            links.push(GraphLink {
                from: end,
                to: sw,
                bandwidth: bw,
                delay,
            });
            links.push(GraphLink {
                from: sw,
                to: end,
                bandwidth: bw,
                delay,
            });
        }
        let kinds = vec![
            NodeKind::Endpoint,
            NodeKind::Endpoint,
            NodeKind::Endpoint,
            NodeKind::Switch,
        ];
        let graph = NetGraph::from_parts(kinds, links, 1).unwrap();
        let mut flows = FlowSet::default();
        flows.push_p2p("one", 1, 0, Bytes(10_000_000), Picos::ZERO);
        (graph, flows)
    }

    /// The gap skip goes from a step between the cables' transmissions to the next one only
    /// while nothing could happen in between: each thing that could, alone, keeps the next
    /// step (see "Steps between transmissions" in the module's docs).
    #[test]
    fn a_gap_is_skipped_only_where_nothing_can_happen_in_it() {
        let (graph, flows) = two_strides();
        let cfg = PacketConfig::default().sanitized();
        let routes = Routes::compute(&graph, &flows).unwrap();
        let copies = vec![1; graph.num_nodes()];
        let fresh = || {
            let mut f = Fluid::new(
                &cfg, 500_000, &graph, &flows, &routes, &copies, true, true, 2,
            );
            // The flow is released and sends at step 0; its bytes are on the first cable.
            f.step(0);
            f
        };
        let (nic, to_receiver, short) = (2u32, 1u32, 4u32);
        assert_eq!(fresh().links[nic as usize].stride, 2);
        assert_eq!(fresh().links[short as usize].stride, 1);
        // Nothing pending: step 1 is skipped, step 2 (a transmission) is not.
        assert_eq!(fresh().skip_gap(1), 2);
        assert_eq!(fresh().skip_gap(2), 2);
        // A release in step 1.
        let mut f = fresh();
        f.releases.insert((Picos(700_000), 0));
        assert_eq!(f.skip_gap(1), 1);
        // A pause reaching its transmitter at step 1.
        let mut f = fresh();
        f.pause_calendar.insert((1, to_receiver), true);
        assert_eq!(f.skip_gap(1), 1);
        // An ACK due at a cable between its transmissions.
        let mut f = fresh();
        f.acks_off_grid_until = 3;
        assert_eq!(f.skip_gap(1), 1);
        // A pause PFC would send: the ingress of the sender's cable holding more than the
        // switch's whole pool.
        let mut f = fresh();
        f.links[nic as usize].in_bytes = 1e12;
        f.pfc_links.push(nic);
        assert_eq!(f.skip_gap(1), 1);
        // A link that transmits every step, listed with a queue pair to serve; listed for
        // a frozen flow's load only, it changes nothing.
        let mut f = fresh();
        f.list(short);
        f.links[short as usize].qps.push(0);
        assert_eq!(f.skip_gap(1), 1);
        let mut f = fresh();
        f.list(short);
        f.links[short as usize].frozen_flows.push(0);
        assert_eq!(f.skip_gap(1), 2);
        // A frozen flow's thaw at step 1, and something that reached a frozen flow's link
        // (a pause) by then.
        let frozen = |f: &mut Fluid, at: u64| {
            let link = &mut f.links[to_receiver as usize];
            link.frozen_flows.push(0);
            f.frozen_links.push(to_receiver);
            f.thaws.insert((at, 0));
        };
        let mut f = fresh();
        frozen(&mut f, 1);
        assert_eq!(f.skip_gap(1), 1);
        let mut f = fresh();
        frozen(&mut f, 100);
        assert_eq!(f.skip_gap(1), 2);
        f.links[to_receiver as usize].paused = true;
        assert_eq!(f.skip_gap(1), 1);
    }
}
