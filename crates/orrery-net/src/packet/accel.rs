//! Steady-state fast-forwarding (issue 4, mechanisms 1 and 2: whole-network jumps, or
//! per-partition jumps with `accel.partitioning`).
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
//! - if it is *recovering* (no rate decrease within the window, its rate-increase timer
//!   running, a target more than `rate_theta` above its rate), its rate will change by
//!   more than that at the next increase. The whole-network jump, which keeps every clock
//!   in local time, takes such a flow as not steady. A partitioned jump (below) takes it
//!   as steady until that increase: the jump stops there, and the flow's DCQCN clocks
//!   (the increase timer, alpha's decay) keep their own time through it instead of being
//!   postponed with the partition, as time passes for them in the run stood in for. A
//!   flow climbing back to line rate after a rival left (one increase per 900 us) is thus
//!   jumped between its increases; with its clocks postponed instead, each jump would
//!   delay the next increase, and such a flow finished 71% late in the test.
//!
//! Flows steady, the *queues* on their links must be too, since a jump freezes them. At
//! each sample the engine also records every switch egress queue on a sampled flow's
//! links, and [`Engine::queues_steady`] compares the mean of a queue's second half-window
//! with its first. With DCQCN, a queue under its ECN threshold that grows and would reach
//! the threshold before the flows end is not steady (frozen, it would reach it a jump's
//! length late, and the first mark halves a rate: a bounded jump does not help, as the
//! queue is as far from the threshold after it), nor is one over the threshold while
//! none of the flows has been cut within the window, nor one over it drifting by more
//! than `queue_theta` of its link's speed; without DCQCN, one drifting by more than that
//! (PFC would pause its senders). The common case is a NIC that receives a flow while it
//! sends one: the link into it carries the first at its sender's line rate and the ACKs
//! of the second (8% of the link with per-packet ACKs), and its queue grows for a few
//! hundred microseconds to its first mark while every flow delivers at a flat rate. Before
//! this test, a two-flow chain at 400 Gb/s jumped with that queue short of the mark and
//! its first flow finished 33% early; the 405B pipeline's 1F1B warm-up waves on 128 GPUs
//! were 5.7% off in the mean and 53% at p99 (`tests/accel.rs`, docs/benchmarks.md). A
//! queue growing where it is its flows' bottleneck changes no completion (they complete
//! at the rate it serves them), so a queue that stays under the threshold is let be.
//!
//! A steady flow's *rate* is the slope of its delivery curve over the second half of the
//! window: the bytes delivered between its last in-order delivery before the window's middle
//! sample and its last one now, over the time between them (the mean per sample if it
//! delivered nothing in between). For a flow that delivers a packet every fixed period this
//! is the period's rate exactly, where a count of packets per sample is off by up to one in
//! each; the first half is left out because it may still hold the end of a start-up. Alone
//! at line rate, a 20 MB flow jumped at its count per sample over the whole window (the
//! fraction of a packet dropped) finished 384 ns late (4.4 frames at 100 Gb/s); at the
//! slope, rounded to the nearest packet, 38 ns (`tests/accel.rs`). Delivery times are
//! kept on the flow's own clock: bytes a jump moved are not counted, and a partitioned
//! jump moves the flow's last delivery time with the rest of its clocks.
//!
//! When every active flow is steady the network *jumps* by `J`, the smallest of: the time to
//! the next pending flow release; for each flow, the time its sender needs at its rate to
//! reach its last packet, minus `tail_margin`. Jumps under `min_jump` are not taken. A jump
//! of `J`:
//! - moves each flow forward by `k = rate * J / mtu` packets, rounded to the nearest whole
//!   one (the remainder, within half a packet either way, is carried to the next jump):
//!   sender and receiver sequence numbers, every in-flight or queued
//!   packet of the flow (data and ACK/NACK sequence numbers), delivered and sent bytes, the
//!   payload bytes of every link on its path, and its ACK count;
//! - leaves everything else as it is: queue occupancy, PFC state, DCQCN state, timers and
//!   in-flight packets' positions. Time is an offset: the engine's clock and every pending
//!   event stay where they are and the *global* clock (what the report shows) is the local
//!   one plus the total jumped time, so a jump costs O(live packets + active flows +
//!   pending releases), not a rewrite of the event queue. Pending releases, whose global
//!   times are fixed, are moved back by `J` with `CalendarQueue::reschedule` (one queue push
//!   each).
//!
//! Releases are the only events that come from outside the network, and all of them are
//! known when the jump is planned (a release is scheduled when its last dependency
//! finishes, and no flow finishes inside a jump), so with one partition no unannounced
//! event can reach it during a jump and no rollback is needed.
//!
//! ## Partitioning (`accel.partitioning`)
//!
//! A *partition* is a connected component of the bipartite graph of member flows and the
//! directed links they use (data path and ACK/CNP reverse path). Members are the active
//! flows and the *draining* ones (finished, packets still in flight), so every packet on a
//! partition's links belongs to one of its flows. Partitions share nothing but the switch
//! buffer pools (which a jump leaves as they are): ECN marking draws are keyed by packet
//! and link rather than taken from one stream, so a jump of one partition, which skips its
//! packets' draws, leaves every other partition's draws as they were. Each partition
//! decides steadiness and jumps on its own.
//!
//! - **Maintained incrementally** ([`super::partition::Partitions`]): a flow that joins
//!   merges the partitions its links touch, and a flow that leaves triggers a split check
//!   of its own partition only. Partitions are read only at samples, so each sample hands
//!   its member set over and the joins and leaves since the last one are applied then.
//!   Cost per sample: O(members) to find who joined and left, O(path length) per join or
//!   leave, the size of the partitions that lost a member, plus the pending releases (a
//!   list kept as releases are scheduled, so not one slot per flow) times their path
//!   length. Every debug run checks the partitions against a recomputation from every
//!   member's links (what each sample did before). A release or completion stamps its
//!   flow's links with the sample count; a partition holding a freshly stamped link has
//!   changed, and its flows' fresh-sample counts restart (a split leaves every piece
//!   holding a link of the flow that left, so pieces restart too).
//! - **Steadiness** is the whole-network test applied to the partition's flows, on
//!   per-flow sample counts (a frozen flow records none), and a partition with a draining
//!   member is not steady.
//! - **Quiet partitions** (`accel.quiet_window`, 3 samples by default; 0 turns them off)
//!   need a shorter observation. A partition is quiet at a sample when no switch egress
//!   queue on its links holds enough bytes to be ECN-marked, none of its ports is paused
//!   or pausing, and with DCQCN no flow has a cut waiting for its decrease period. Its
//!   flows are then held back by their senders' ports and DCQCN rates and by the FIFOs
//!   that serve them: nothing can mark them, so a rate changes only when a flow
//!   recovering from an earlier cut reaches its next increase (the jump stops there, as
//!   for a recovering flow below, its DCQCN clocks keeping their own time), a queue
//!   reaches its threshold, or a flow starts or ends, and the long window, which exists
//!   to wait out DCQCN's cuts and recoveries, has nothing to wait for. Queues deeper than
//!   a frame are tested over the samples the partition has been quiet in a row: one
//!   growing towards its threshold, or draining after a cut, is carried through the jump
//!   instead of frozen (the [`carry`] module: a 1F1B stage receiving while it sends, its
//!   inbound queue growing under its own send's ACKs, then draining once the incoming
//!   flow is cut; carrying the drains too took that row from 11.1M events to 8.2M at 2 us
//!   samples). Before calm queues were carried (quiet meant at most one packet queued),
//!   the 405B pipeline bench row on 128 GPUs took 28,702,190 events; with them,
//!   16,310,975. Before recovering flows were let in (they had to be at line rate with no
//!   timer running), the 405B
//!   pipeline bench row on 128 GPUs took 30,859,059 events, its warm-up sends waiting out
//!   a whole window after each cut (docs/benchmarks.md). A partition quiet at each of
//!   its last `quiet_window` fresh samples is tested over those samples only (delivered
//!   spread under `theta`, the rate from the slope over their second half) and, steady,
//!   jumps to `quiet_tail_margin` (10 us) before its earliest completion instead of
//!   `tail_margin` (50 us, which leaves room for a CNP interval), plus, where a queue
//!   stands deeper than a frame, the time it takes to drain, as the last packets wait
//!   behind it. A queue that builds (senders above a link's speed) or drains is carried,
//!   or holds the jump back while its course is too slow to measure; one that reaches its
//!   threshold or pauses a sender makes the partition not quiet until that has passed.
//!   Quiet jumps are counted in [`super::PacketStats::quiet_jumps`]. On uncongested training traffic
//!   (rail-local data-parallel rings, lone pipeline sends) most jumps are quiet ones: the
//!   bench's GPT 350M step on 64 GPUs went from 2,305,751 events to 1,054,133, with the
//!   same p99 flow error against the reference (0.046%).
//! - **Cut jumps** (`accel.cut_jumps`, on by default). Two flows colliding on a port
//!   settle into a stretch that no test above lets through: the port's queue stands at
//!   PFC's threshold, every packet is marked, and each CNP (one per `cnp_interval`) cuts
//!   each flow's DCQCN rate by about 1% (alpha near its equilibrium), while what the
//!   flows deliver is set by the port and PFC, not by their rates: on two 50 MB flows
//!   into one 400 Gb/s port, ~1 ms of 2.6 ms, the rates falling from 257 to 200 Gb/s
//!   while each delivers 200. A flow is *cutting* when its rate moved over the window but
//!   its receiver sent CNPs in one unbroken run through it, each at most a tenth of an
//!   interval late (`FlowState::cnp_run_since`: its packets are marked often enough that
//!   DCQCN cuts it at that cadence), its rate only fell (at its lowest, in no increase
//!   stage), and it still sends more than `theta` above its delivered rate. A partition
//!   whose flows are steady or cutting jumps as any other, bytes moving at the delivered
//!   rates and queues frozen, but each cutting flow's DCQCN state lives through the jump
//!   instead of standing still: it is driven through the CNPs it would have received
//!   ([`ReactionPoint::drive`]: at the run's mean cadence after its last, each reaching the
//!   sender after the reverse path's latency) with the decrease ticks they schedule, and
//!   its pending decrease and increase events are rescheduled from the state it is left
//!   in. The jump stops before any cutting flow's rate comes within `theta` of what it
//!   delivers (from there its rate sets its pace) or its increase timer would fire. A
//!   flow in such a run delivers what the congested port's share and PFC's pauses give
//!   it, which jitter from one 2.5 us sample to the next about a steady mean, so its
//!   delivered spread is tested on blocks of a quarter window (50 us) instead of on
//!   single samples (on the ECMP step at 512 GPUs: 434.7M events with them, 442.2M with
//!   single samples). Approximated: the CNP times (the run's mean cadence), a CNP in
//!   flight at the jump (it arrives after the thaw, one cut late), and ECN's draws and the
//!   CNPs themselves, not counted, as for every jump. The state matters once a flow runs
//!   on alone at the rate DCQCN left it: with 40 and 50 MiB flows the longer ends 0.017%
//!   off the reference, where freezing its state through the same jump left its rate
//!   higher and it ended 0.96% early (`tests/accel.rs`). Counted in
//!   [`super::PacketStats::cut_jumps`]; the two 50 MB flows take 355,021 events instead
//!   of 554,106, a 4-to-1 incast of 50 MB flows 331,403 instead of 1,389,029.
//!
//!   [`ReactionPoint::drive`]: super::dcqcn::ReactionPoint::drive
//! - **The jump** of partition `P` by `J` (the whole-network limit restricted to `P`'s
//!   flows and to the pending releases whose links touch `P`, and to the next rate
//!   increase of each recovering flow of `P`, rounded down to whole sample intervals so
//!   `P` thaws on a sample) moves bytes and sequence numbers exactly as the whole-network
//!   jump does, then *postpones* `P` by `J` instead of moving a global offset: every
//!   pending event of `P` (packet arrivals of its flows, port events of its links, its
//!   flows' timers but a recovering flow's rate increase) is rescheduled `J` later and
//!   every time `P`'s flows and ports keep (pacing, RTO progress, CNP spacing, DCQCN clocks
//!   but a recovering flow's, port wake-ups) moves `J` later, so `P` is frozen, queues and
//!   all, until `now + J` and then resumes as if no time had passed. No other partition's ports or events change. Global time stays the engine's
//!   time (`offset` stays zero), so flow starts and finishes need no translation.
//! - **Finding `P`'s events**: with partitioning the engine records every flow or link
//!   event it schedules in a ledger (key, time, event), compacted to the pending ones
//!   whenever it has doubled (amortised O(1) per event; a jump skips the stale entries,
//!   whose keys no longer name a pending event). A jump visits its own events through the
//!   ledger's index by owner ([`super::image::LedgerIndex`], which the memo's captures
//!   use too: the positions of its flows' and links' events, plus whatever was scheduled
//!   since the index was built) and its own packets (those in flight are the arrivals
//!   among its events, the others wait in its links' queues), and moves each of its
//!   events with one queue push: O(its events and packets, plus the ledger's newest
//!   entries), not O(1) as the per-partition queues would; the ledger costs one
//!   push per scheduled event. Until 2026-12-07 every jump scanned the whole ledger and
//!   every slot of the packet arena: on the ECMP GPT 350M step at 1,024 GPUs, 5,239 jumps
//!   visited 111M ledger entries and 1,393M arena slots, where they now visit 45M entries
//!   and 2.7M packets (and the index hashes 15M entries as it is rebuilt). In `perf`
//!   profiles the jump and its visits went from 2.0% of the 512-GPU step to 1.2%, and
//!   from about 6.1% of the 1,024-GPU step to 4.4% (most of that is the jump's own
//!   tests, not its visits), gains that wall times on this machine do not resolve; with
//!   partitions joined by data paths
//!   only (an experiment, docs/benchmarks.md) the arena scan had been a quarter of the
//!   512-GPU step's profile. Debug runs check both visits against the scans. Why not a queue per
//!   partition: in a `perf` profile of the accelerated 256-GPU GPT 350M step, the
//!   partitioned samples took about 0.25% of the run (the jumps did not register) and the
//!   ledger's compaction, then done at every sample, about 3.4%, while the calendar
//!   queue's own pushes and pops took about half. Per-partition queues under a queue of
//!   partitions would add a second level to every push and pop to save part of that, and
//!   would not make a jump O(1): it moves its flows forward by whole packets, so it
//!   renumbers every packet of the partition in flight or queued and moves the times its
//!   flows and ports keep, which is O(its packets and flows) whatever holds its events.
//!   (A binary heap in place of the calendar queue, tried on 2026-12-07 for the sparse
//!   accelerated runs, gave the same output 35% slower: 0.55 s against 0.40 s on the 405B
//!   pipeline step.) (At
//!   2.5 us samples the compaction at every sample took about 2.2% of the 405B pipeline
//!   step's profile; waiting for the ledger to double, as without fast-forwarding, 0.5%,
//!   with the same output.)
//! - **Releases**: a partition never jumps past a pending release whose flow's links touch
//!   it (a new flow's route is known), nor past the earliest time a release not scheduled
//!   yet could touch it. Releases of the partition's own dependents cannot come during the
//!   jump (none of its flows finishes while it is frozen), but a flow of *another*
//!   partition may finish meanwhile and release a flow onto it, directly or through a
//!   chain of flows not released yet; [`Engine::unannounced_release_bound`] bounds those
//!   from below (each flow finishing no sooner than its remaining packets take at its
//!   slowest link's speed) and the jump stops there. Without it a ring step released 2.5 us
//!   into a neighbour partition's 110 us quiet jump met that partition's frozen port and
//!   took 348 us instead of 189, and the run ended 3.4% late (`tests/accel.rs`). A release
//!   that merges partitions therefore finds all of them at the release time: no rollback is
//!   needed. A partition frozen past a release touching no link of it is fine: the new
//!   flow cannot reach it.
//! - **What held a partition back** is counted at every sample, once per flow of the
//!   partition, under its jump or the first test it failed ([`super::FastForwardHeld`],
//!   `orrery netsim`'s report): each test returns its [`super::HeldBy`] when it fails.
//!   Until it was counted, each look at why a run did not jump was a temporary diagnostic
//!   written anew.

mod carry;

use super::engine::{Engine, Ev, FlowState, Kind};
use super::image::{owner_of, Owner};
use super::partition::Partitions;
#[cfg(debug_assertions)]
use super::partition::{components, find};
use super::HeldBy;
use orrery_des::EventQueue;
use orrery_units::Picos;

const NONE: u32 = u32::MAX;

/// The fewest blocks of samples a steadiness test looks at ([`Engine::steady_rate`]).
const MIN_BLOCKS: usize = 3;

/// Samples per block of a steadiness test for a flow delivering `per_sample` packets per
/// sample: enough for `2 / theta` packets, so the one packet by which an even pace's counts
/// differ is at most half of `theta`. `None` when `theta` leaves no room for that (zero).
fn block_samples(per_sample: f64, theta: f64) -> Option<usize> {
    if !(theta > 0.0 && per_sample > 0.0) {
        return None;
    }
    let block = (2.0 / theta / per_sample).ceil();
    // A block longer than any window is as good as none.
    (block <= 1e9).then(|| (block as usize).max(1))
}

/// The CNPs a cutting flow receives (see "Cut jumps" in the module essay): its receiver
/// goes on sending one per `period`, its run's mean cadence, each reaching the sender
/// after the reverse path's latency.
struct CnpTrain {
    /// When the receiver sent its last CNP.
    last_sent: Option<Picos>,
    /// Between two CNPs.
    period: u64,
    /// From the receiver to the sender.
    latency: u64,
}

impl CnpTrain {
    /// When the CNPs sent after the last one reach the sender, from the first after `now`.
    fn arrivals(&self, now: Picos) -> impl Iterator<Item = Picos> {
        let (period, latency) = (self.period.max(1), self.latency);
        let sent = self.last_sent.map_or(now.0, |t| t.0);
        (1u64..)
            .map(move |k| Picos(sent + k * period + latency))
            .filter(move |t| *t > now)
    }

    /// How many of the CNPs reach the sender after `now` and before `until`, and when
    /// the receiver sent the last of them.
    fn sent_during(&self, now: Picos, until: Picos) -> (u32, Option<Picos>) {
        let latency = self.latency;
        self.arrivals(now)
            .take_while(|t| *t < until)
            .fold((0, None), |(n, _), t| (n + 1, Some(Picos(t.0 - latency))))
    }
}

/// What the steadiness test found about one steady flow.
struct Steady {
    /// Delivered rate (the slope over the second half of the window), bytes per second.
    rate: f64,
    /// The time its sender needs at `rate` to reach its last packet.
    t_left: Picos,
    /// When its rate-increase timer fires, if it is *recovering*: no rate cut within the
    /// window, a target above its rate, the timer running. Its rate holds until then and
    /// changes then, so a partitioned jump may go that far and no farther, and its DCQCN
    /// clocks keep their own time through the jump: in the run being stood in for, time
    /// passes for its timer (and its alpha decays with no CNP to feed it).
    recovering_until: Option<Picos>,
    /// Its rate was cut within the window (or it was released within it): DCQCN is at
    /// work on it, which [`Engine::queues_steady`] asks of a queue over its threshold.
    cut_in_window: bool,
    /// Its DCQCN rate is falling, cut after cut at the cadence its receiver's run of CNPs
    /// keeps (this many picoseconds apart), while it still sends more than `theta` above
    /// what it delivers: a cut jump may carry it (see [`AccelConfig::cut_jumps`] and "Cut
    /// jumps" in the module essay).
    ///
    /// [`AccelConfig::cut_jumps`]: super::AccelConfig::cut_jumps
    cutting: Option<u64>,
}

/// Fast-forwarding state: per-flow rings of delivered-bytes samples and the active set.
#[derive(Debug)]
pub(crate) struct FastForward {
    window: usize,
    /// Each flow's ring of samples (`NONE` until its first sample, and again once it has
    /// finished): ring `r` holds `window` samples from `r * window`, sample `n` of its
    /// flow in slot `n % window`. Rings are taken from `free_rings` before new ones are
    /// added, so the rings held are those of the flows sampled at once, not of every flow
    /// (an 8,192-GPU step has 554,880 flows; `window` samples of 32 bytes for each was
    /// 1.4 GB of address space).
    ring_of: Vec<u32>,
    free_rings: Vec<u32>,
    /// Delivered bytes per sample.
    ring: Vec<u64>,
    /// The sending rate (DCQCN rate) at each sample, same layout.
    rate_ring: Vec<f64>,
    /// The flow's last in-order delivery before each sample, same layout: its delivered
    /// bytes and its time, both on the flow's own clock (bytes and time of jumps taken
    /// out, see [`FastForward::jumped_bytes`]), so a steady flow's rate is the slope
    /// between two of them rather than a count of packets per sample.
    point_ring: Vec<(u64, Picos)>,
    /// Bytes jumps moved for the flow, and (partitioned jumps) the time they froze it.
    jumped_bytes: Vec<u64>,
    jumped_time: Vec<Picos>,
    last_delivered: Vec<u64>,
    /// Rate decreases seen at the last sample, and the sample number when that changed.
    last_dec: Vec<u64>,
    last_dec_sample: Vec<u64>,
    /// Each link's data queue (bytes) at its last `window` samples, sample `n` of link
    /// `l` in slot `l * window + n % window`; kept for switch egress ports only (a host
    /// port's queue pairs wait in their senders, not in a buffer).
    queue_ring: Vec<u64>,
    /// Samples recorded per link (a link of a frozen partition records none).
    link_samples: Vec<u64>,
    /// Fractional packets carried from one jump to the next.
    frac: Vec<f64>,
    /// Packets each flow moves in the jump being applied (zero otherwise).
    shift: Vec<u64>,
    /// In the jump being applied, the packets a flow appends to a growing queue it goes
    /// through, or (negative) loses from a draining one (zero otherwise), and that queue's
    /// hop on its path: its packets before that hop move by these too (see the `carry`
    /// module).
    carry: Vec<i64>,
    carry_hop: Vec<u32>,
    /// The lowest sequence number among a carried flow's packets before its growing
    /// queue, before renumbering (`u64::MAX`: none), found by the renumbering.
    carry_first: Vec<u64>,
    active: Vec<u32>,
    active_pos: Vec<u32>,
    /// Samples taken, and samples since the last release or completion.
    samples: u64,
    since_change: u64,
    /// A sample event is pending.
    pending: bool,
    /// Per-partition state (`accel.partitioning` only).
    parts: Option<Parts>,
}

/// Bookkeeping of per-partition fast-forwarding (see the module essay).
#[derive(Debug)]
struct Parts {
    /// Samples recorded per flow (a frozen flow records none), indexing its ring.
    nsamp: Vec<u64>,
    /// Samples recorded since the last change of the flow's partition.
    fresh: Vec<u64>,
    /// Of those, the latest consecutive ones at which its partition was quiet (see
    /// [`Engine::partition_quiet`]).
    quiet: Vec<u64>,
    /// The flow's partition is frozen by a jump until this time.
    frozen_until: Vec<Picos>,
    /// The global sample count when a flow using the link last started or finished.
    link_stamp: Vec<u64>,
    /// The partitions, maintained incrementally from one sample to the next.
    parts: Partitions,
    /// The earliest pending release touching each partition, by partition id (valid
    /// during one sample).
    rel_limit: Vec<u64>,
    /// The flow is in the partition being jumped.
    in_group: Vec<bool>,
    /// The flow of the partition being jumped is recovering (see [`Steady`]):
    /// its DCQCN clocks and rate-increase timer keep running through the jump.
    keeps_clock: Vec<bool>,
    /// Scratch: the flows of the jumping partition whose DCQCN state lives through the
    /// jump (a cut jump's cutting flows).
    cutting: Vec<bool>,
    /// Finished flows that still have packets in flight: partition members, never steady.
    draining: Vec<u32>,
}

impl FastForward {
    pub fn new(flows: usize, window: usize, links: usize, partitioning: bool) -> FastForward {
        let parts = partitioning.then(|| Parts {
            nsamp: vec![0; flows],
            fresh: vec![0; flows],
            quiet: vec![0; flows],
            frozen_until: vec![Picos::ZERO; flows],
            link_stamp: vec![u64::MAX; links],
            parts: Partitions::new(flows, links),
            rel_limit: Vec::new(),
            in_group: vec![false; flows],
            keeps_clock: vec![false; flows],
            cutting: vec![false; flows],
            draining: Vec::new(),
        });
        FastForward {
            parts,
            window,
            ring_of: vec![NONE; flows],
            free_rings: Vec::new(),
            ring: Vec::new(),
            rate_ring: Vec::new(),
            point_ring: Vec::new(),
            jumped_bytes: vec![0; flows],
            jumped_time: vec![Picos::ZERO; flows],
            last_delivered: vec![0; flows],
            last_dec: vec![0; flows],
            last_dec_sample: vec![0; flows],
            queue_ring: vec![0; links * window],
            link_samples: vec![0; links],
            frac: vec![0.0; flows],
            shift: vec![0; flows],
            carry: vec![0; flows],
            carry_hop: vec![0; flows],
            carry_first: vec![u64::MAX; flows],
            active: Vec::new(),
            active_pos: vec![NONE; flows],
            samples: 0,
            since_change: 0,
            pending: false,
        }
    }
}

impl FastForward {
    /// Flow `i`'s last in-order delivery (bytes and time) on its own clock.
    fn point(&self, i: usize, fl: &FlowState) -> (u64, Picos) {
        // A flow's jumps are counted in its own counters, and a broken mirror (which had
        // none) takes its leader's, so neither subtraction can go below zero; the debug
        // builds (the tests) check it, and release builds saturate.
        debug_assert!(
            fl.delivered >= self.jumped_bytes[i] && fl.delivered_at >= self.jumped_time[i],
            "flow {i}: delivery point below its jumps"
        );
        (
            fl.delivered.saturating_sub(self.jumped_bytes[i]),
            Picos(fl.delivered_at.0.saturating_sub(self.jumped_time[i].0)),
        )
    }

    /// Records flow `i`'s sample number `sample` (the whole network's count, or the flow's
    /// own in a partition): its bytes delivered since the last one, its sending rate, its
    /// delivery point, and when its rate decreases last changed.
    fn record_sample(&mut self, i: usize, sample: u64, fl: &FlowState) {
        let at = self.ring_start(i) + (sample % self.window as u64) as usize;
        self.ring[at] = fl.delivered - self.last_delivered[i];
        self.rate_ring[at] = fl.rp.rate;
        self.point_ring[at] = self.point(i, fl);
        self.last_delivered[i] = fl.delivered;
        if fl.rp.decreases != self.last_dec[i] {
            self.last_dec[i] = fl.rp.decreases;
            self.last_dec_sample[i] = sample;
        }
    }

    /// Where flow `i`'s ring starts, giving it one if it has none. A ring taken over from a
    /// finished flow still holds that flow's samples, but every reader reads only the
    /// samples its own flow recorded since its partition last changed (its release is
    /// such a change), so those are never read.
    fn ring_start(&mut self, i: usize) -> usize {
        let w = self.window;
        if self.ring_of[i] == NONE {
            self.ring_of[i] = self.free_rings.pop().unwrap_or_else(|| {
                let r = (self.ring.len() / w) as u32;
                self.ring.resize(self.ring.len() + w, 0);
                self.rate_ring.resize(self.rate_ring.len() + w, 0.0);
                self.point_ring
                    .resize(self.point_ring.len() + w, (0, Picos::ZERO));
                r
            });
        }
        self.ring_of[i] as usize * w
    }

    /// Where flow `i`'s ring starts, if it has one.
    fn ring_at(&self, i: usize) -> Option<usize> {
        let r = self.ring_of[i];
        (r != NONE).then(|| r as usize * self.window)
    }

    /// Flow `i` has finished: its ring goes back to the pool.
    fn release_ring(&mut self, i: usize) {
        let r = std::mem::replace(&mut self.ring_of[i], NONE);
        if r != NONE {
            self.free_rings.push(r);
        }
    }

    /// Records link `l`'s data queue (`queued` bytes) as its next sample.
    fn record_queue(&mut self, l: usize, queued: u64) {
        let n = self.link_samples[l];
        self.queue_ring[l * self.window + (n % self.window as u64) as usize] = queued;
        self.link_samples[l] = n + 1;
    }

    /// Adds `delta` bytes (at least down to empty) to every sample link `l`'s ring holds.
    fn shift_queue_history(&mut self, l: usize, delta: i64) {
        let kept = self.link_samples[l].min(self.window as u64) as usize;
        let ring = &mut self.queue_ring[l * self.window..(l + 1) * self.window];
        for q in &mut ring[..kept] {
            *q = q.saturating_add_signed(delta);
        }
    }

    /// Link `l`'s queue (bytes) `back` samples ago, 1 being its latest sample (`back` at
    /// most the window and at most the link's samples).
    fn queue_sample(&self, l: u32, back: u64) -> u64 {
        let n = self.link_samples[l as usize];
        self.queue_ring[l as usize * self.window + ((n - back) % self.window as u64) as usize]
    }

    /// Flow `i`'s delivered rate over the second half of its last `span` samples (it has
    /// taken `samples`, more than `span`; `span` at most the window), bytes per second:
    /// the slope between its last delivery before the middle sample and its last one now,
    /// if they are apart.
    fn slope(&self, i: usize, fl: &FlowState, samples: u64, span: usize) -> Option<f64> {
        let w = self.window as u64;
        let middle = samples.checked_sub(1 + span as u64 / 2)?;
        let (b0, t0) = self.point_ring[self.ring_at(i)? + (middle % w) as usize];
        let (b1, t1) = self.point(i, fl);
        (b1 > b0 && t1 > t0).then(|| (b1 - b0) as f64 / Picos(t1.0 - t0.0).as_secs_f64())
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
        ff.last_dec_sample[i] = match &ff.parts {
            Some(p) => p.nsamp[i],
            None => ff.samples,
        };
        ff.since_change = 0;
        if let Some(p) = ff.parts.as_mut() {
            stamp(p, &self.paths, &self.flows[i], ff.samples);
        }
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
        ff.release_ring(f as usize);
        if let Some(p) = ff.parts.as_mut() {
            stamp(p, &self.paths, &self.flows[f as usize], ff.samples);
            p.draining.push(f);
        }
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
        if ff.parts.is_some() {
            self.ff_sample_parts(&mut ff);
            self.ff = Some(ff);
            return;
        }
        if !ff.active.is_empty() {
            let w = ff.window;
            for k in 0..ff.active.len() {
                let i = ff.active[k] as usize;
                ff.record_sample(i, ff.samples, &self.flows[i]);
            }
            for (l, port) in self.ports.iter().enumerate() {
                if port.from_switch {
                    ff.record_queue(l, port.queued);
                }
            }
            ff.samples += 1;
            ff.since_change += 1;
            if ff.since_change > w as u64 {
                self.try_jump(&mut ff);
            }
            // Other events besides this one and a trace sample: the run is not over.
            if self.unfinished > 0 && self.pending_beyond(self.trace_pending()) {
                ff.pending = true;
                let at = Picos(self.now.0.saturating_add(self.cfg.accel.sample_interval.0));
                self.q.schedule(at, Ev::FfSample);
            }
        }
        self.ff = Some(ff);
    }

    /// Jumps ahead if every active flow is steady (see the module essay).
    /// Moves flow `i` forward by the whole packets `bytes_due` (its rate times the jump) is
    /// worth, carrying the fraction to the next jump: sequence numbers at both ends, the
    /// byte counters of the flow, the run and every link of its path, and its ACK count.
    /// Records the shift for [`Engine::renumber_packets`] and returns the packets moved.
    fn advance_flow(&mut self, ff: &mut FastForward, i: usize, bytes_due: f64) -> u64 {
        let mtu = u64::from(self.cfg.mtu_payload);
        let ack_every = u64::from(self.cfg.ack_every);
        let x = bytes_due / mtu as f64 + ff.frac[i];
        // To the nearest packet: the remainder carried to the next jump is lost if there
        // is none, so it is kept within half a packet either way.
        let whole = x.round().max(0.0);
        ff.frac[i] = x - whole;
        let fl = &mut self.flows[i];
        let k = (whole as u64).min(fl.npkts - 1 - fl.snd_nxt);
        if k == 0 {
            return 0;
        }
        ff.shift[i] = k;
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
        ff.jumped_bytes[i] += bytes;
        self.bytes_sent += bytes;
        self.bytes_delivered += bytes;
        self.stats.acks += acks;
        let (start, len) = fl.fwd;
        for h in start..start + len {
            self.link_bytes[self.paths[h as usize] as usize] += bytes;
        }
        k
    }

    /// Every live packet of a moved flow, wherever it is, takes the moved numbering (CNPs
    /// carry no sequence number): the receiver's, but a carried flow's data packets
    /// before its carried queue take the sender's, ahead by the packets appended to a
    /// growing queue (their lowest number before the move is left in `carry_first`) or
    /// behind by those taken out of a draining one.
    fn renumber_packets(&mut self, ff: &mut FastForward) {
        for q in self.live_slots() {
            renumber(ff, &mut self.pkts[q as usize]);
        }
    }

    /// The arena slots holding a live packet, in slot order.
    fn live_slots(&self) -> Vec<u32> {
        let mut free = vec![false; self.pkts.len()];
        for &q in self.free_slots() {
            free[q as usize] = true;
        }
        (0..self.pkts.len() as u32)
            .filter(|&q| !free[q as usize])
            .collect()
    }

    /// [`Engine::renumber_packets`] for a partition's jump, visiting only the partition's
    /// packets instead of every slot of the arena: those queued on its `links` and those
    /// in flight, whose arrivals are among its pending events (`positions` in the ledger,
    /// [`Engine::group_positions`]). Every packet of its flows is one or the other (a
    /// frame is handed to the next hop's arrival as it starts), and every packet on its
    /// links is one of its flows' (a partition holds the links of both directions), so
    /// this renumbers what the arena scan would: with many small partitions jumping, the
    /// scan of every slot for each jump took a quarter of a run (data-path partitions on
    /// the ECMP GPT 350M step at 512 GPUs, docs/benchmarks.md).
    fn renumber_group_packets(&mut self, ff: &mut FastForward, links: &[u32], positions: &[u32]) {
        let ledger = self.ledger.as_deref().unwrap_or(&[]);
        let mut mine: Vec<u32> = positions
            .iter()
            .filter_map(|&i| match ledger[i as usize].2 {
                Ev::Arrive(pk) => Some(pk),
                _ => None,
            })
            .collect();
        for &l in links {
            let port = &self.ports[l as usize];
            mine.extend(port.ctrl.iter().chain(&port.data));
        }
        #[cfg(debug_assertions)]
        {
            // The slow path it replaces: every live packet that the arena scan would
            // renumber (of a flow that moved) is visited, once.
            let moved = |q: &u32| {
                let f = self.pkts[*q as usize].flow as usize;
                ff.shift[f] != 0 || ff.carry[f] != 0
            };
            let expected: Vec<u32> = self.live_slots().into_iter().filter(moved).collect();
            let mut visited = mine.clone();
            visited.sort_unstable();
            let before = visited.len();
            visited.dedup();
            debug_assert_eq!(before, visited.len(), "a packet visited twice");
            visited.retain(moved);
            debug_assert_eq!(visited, expected, "the partition's packets");
        }
        for q in mine {
            renumber(ff, &mut self.pkts[q as usize]);
        }
    }

    /// Moves flow `i`'s sender on by `packets` more than its receiver (the packets a jump
    /// appends for it to the growing queue at `hop` of its path), or back by `-packets`
    /// after its move on by what it delivered (those it lost from the draining queue
    /// there, which its receiver got but its sender did not add): sequence numbers, sent
    /// bytes and the bytes of the links before that hop. A sender moves on at most to its
    /// last packet and back at most by its move (`shift`). Returns the packets it moved.
    fn carry_sender(&mut self, ff: &mut FastForward, i: usize, hop: u32, packets: i64) -> u64 {
        let mtu = u64::from(self.cfg.mtu_payload);
        let on = packets >= 0;
        let step = |x: &mut u64, by: u64| {
            if on {
                *x += by;
            } else {
                *x -= by;
            }
        };
        let fl = &mut self.flows[i];
        let most = if on {
            fl.npkts - 1 - fl.snd_nxt
        } else {
            ff.shift[i]
        };
        let moved = packets.unsigned_abs().min(most);
        if moved == 0 {
            return 0;
        }
        ff.carry[i] = if on { moved as i64 } else { -(moved as i64) };
        ff.carry_hop[i] = hop;
        ff.carry_first[i] = u64::MAX;
        step(&mut fl.snd_nxt, moved);
        step(&mut fl.high, moved);
        let start = fl.fwd.0;
        let bytes = moved * mtu;
        step(&mut self.bytes_sent, bytes);
        for h in start..start + hop {
            step(&mut self.link_bytes[self.paths[h as usize] as usize], bytes);
        }
        moved
    }

    /// The steadiness test of one active flow (see the module docs): its delivered rate in
    /// bytes per second and the time its sender needs at that rate to reach its last packet,
    /// or the test it failed. `samples` is the flow's sample count (the network's,
    /// or its partition's), against which its last rate decrease is dated. The test looks
    /// at the last `span` samples at least: the whole window, or `quiet_window` of them for
    /// a flow of a `quiet` partition (see [`Engine::partition_quiet`]); `avail` is how many
    /// of the flow's latest samples the caller vouches for (taken since the last change,
    /// and quiet ones for a quiet partition).
    ///
    /// The spread `(max - min) / mean < theta` is tested on blocks of consecutive samples
    /// that hold `2 / theta` packets each on average (40 at the default 5%), and over three
    /// blocks at least. A sample counts the packets delivered in its interval, which for a
    /// flow delivering at an even pace is one of two neighbouring whole numbers: a packet
    /// of spread that says nothing about its rate. At 2.5 us a 25 Gb/s flow delivers
    /// about 8 packets per sample, so that packet alone is 13% of it and a test on single
    /// samples would call it unsteady at random; on blocks the packet is at most half of
    /// `theta`. A slow flow thus needs more samples to be found steady (a quiet 25 Gb/s
    /// flow 18 samples, blocks of 6, 45 us; one at 200 Gb/s or more the quiet window's
    /// 3), the time its rate takes to be measured to the same precision.
    fn steady_rate(
        &self,
        ff: &FastForward,
        i: usize,
        samples: u64,
        span: usize,
        avail: u64,
        quiet: bool,
    ) -> Result<Steady, HeldBy> {
        let cfg = self.cfg;
        let a = &cfg.accel;
        let w = ff.window;
        let span = span.clamp(1, w);
        let fl = &self.flows[i];
        if fl.dead || fl.snd_nxt < fl.high || fl.snd_nxt >= fl.npkts {
            return Err(HeldBy::FlowEnding);
        }
        // Sample `n` of the flow is in slot `n % w`; `slot(k)` is its `k`-th latest.
        let start = ff.ring_at(i).ok_or(HeldBy::FlowRateUnmeasured)?;
        let slot = |k: u64| start + ((samples.wrapping_sub(k)) % w as u64) as usize;
        let span_bytes: u64 = (1..=span as u64).map(|k| ff.ring[slot(k)]).sum();
        let per_sample = span_bytes as f64 / span as f64 / f64::from(cfg.mtu_payload.max(1));
        if per_sample <= 0.0 {
            return Err(HeldBy::FlowUnsteady);
        }
        let mut block = block_samples(per_sample, a.theta).ok_or(HeldBy::FlowRateUnmeasured)?;
        // A flow cut at a steady cadence through the window delivers what a congested
        // port's share and PFC's pauses give it, which jitter from one sample to the next
        // about a steady mean: its spread is tested on blocks of a quarter window (50 us),
        // several pause cycles each (see "Cut jumps" in the module essay).
        if !quiet && self.cnp_cadence(fl, w).is_some() {
            block = block.max(w / (MIN_BLOCKS + 1));
        }
        let used = span.max(MIN_BLOCKS * block);
        if used > w || used as u64 > avail {
            return Err(HeldBy::FlowRateUnmeasured);
        }
        let blocks = used / block;
        let (mut lo, mut hi, mut sum) = (u64::MAX, 0u64, 0u64);
        for b in 0..blocks as u64 {
            let x: u64 = (1..=block as u64)
                .map(|k| ff.ring[slot(b * block as u64 + k)])
                .sum();
            lo = lo.min(x);
            hi = hi.max(x);
            sum += x;
        }
        let mean = sum as f64 / blocks as f64;
        if mean <= 0.0 || (hi - lo) as f64 >= a.theta * mean {
            return Err(HeldBy::FlowUnsteady);
        }
        let span = used;
        let slots = (1..=span as u64).map(slot);
        let mut recovering_until = None;
        let cut_in_window = samples.saturating_sub(ff.last_dec_sample[i]) <= w as u64;
        let mut cutting = None;
        if cfg.dcqcn {
            let lo = slots
                .clone()
                .map(|at| ff.rate_ring[at])
                .fold(f64::INFINITY, f64::min);
            let hi = slots.map(|at| ff.rate_ring[at]).fold(0.0, f64::max);
            if hi - lo > a.rate_theta * hi {
                // (A quiet partition has no queue deep enough to mark anything.)
                cutting = (!quiet)
                    .then(|| self.cut_at_cadence(fl, lo, span))
                    .flatten();
                if cutting.is_none() {
                    return Err(HeldBy::DcqcnRateMoving);
                }
            } else if quiet {
                // A quiet partition: nothing can mark its flows, so a flow whose increase
                // timer runs holds its rate until it fires, whatever the size of the
                // change then; the jump stops there, its clocks in their own time.
                recovering_until = fl.rp.next_increase();
            } else if !cut_in_window && fl.rp.target - fl.rp.rate > a.rate_theta * fl.rp.rate {
                recovering_until = fl.rp.next_increase();
            }
        }
        // The slope between two deliveries is exact for a flow that delivers a packet every
        // fixed period, where a count of packets per sample is off by up to one in each. It
        // is taken over the second half of the window: the first half may still hold the
        // last of a start-up (a pair alone at line rate on a cross-pod fabric delivered 4
        // packets fewer in its first 200 us than its steady period gives, and the jump at
        // that rate made it finish 102 ns late). Bytes per second.
        let rate = ff
            .slope(i, fl, samples, span)
            .unwrap_or(mean / block as f64 / a.sample_interval.as_secs_f64());
        // A cutting flow must still send more than `theta` above what it delivers, so that
        // something else (PFC, a shared port) sets its pace and the cuts change nothing yet.
        if cutting.is_some() && fl.rp.rate <= (1.0 + a.theta) * rate {
            return Err(HeldBy::DcqcnRateMoving);
        }
        // Full packets the sender has left before its last one.
        let left = (fl.npkts - 1 - fl.snd_nxt) * u64::from(cfg.mtu_payload);
        Ok(Steady {
            rate,
            t_left: Picos::from_secs_f64(left as f64 / rate),
            recovering_until,
            cut_in_window,
            cutting,
        })
    }

    /// The CNPs flow `f` receives while its run of CNPs goes on at the cadence `period`
    /// ([`Engine::cnp_cadence`]).
    fn cnp_train(&self, f: u32, period: u64) -> CnpTrain {
        let cfg = self.cfg;
        let fl = &self.flows[f as usize];
        let frame = u64::from(cfg.cnp_bytes) + u64::from(cfg.framing_bytes);
        let latency = (fl.rev.0..fl.rev.0 + fl.rev.1)
            .map(|h| {
                let port = &self.ports[self.paths[h as usize] as usize];
                super::engine::ser(frame, port.bw).0 + port.delay.0
            })
            .sum();
        CnpTrain {
            last_sent: fl.last_cnp,
            period,
            latency,
        }
    }

    /// The cadence at which flow `fl`, whose DCQCN rate moved over the `span` samples
    /// tested (its lowest `lowest`), is being cut, if a cut jump may carry it: its
    /// receiver's run of CNPs spans those samples ([`Engine::cnp_cadence`]) and its rate
    /// only fell (it stands at its lowest, in no increase stage). [`Engine::steady_rate`]
    /// then asks it to send more than `theta` above what it delivers.
    fn cut_at_cadence(&self, fl: &FlowState, lowest: f64, span: usize) -> Option<u64> {
        let falling = fl.rp.decreases > 0 && fl.rp.stage == 0 && fl.rp.rate <= lowest;
        self.cnp_cadence(fl, span).filter(|_| falling)
    }

    /// With cut jumps on, the mean time between the CNPs of flow `fl`'s receiver if they
    /// have come in one run (each at most a tenth of `cnp_interval` late) over at least the
    /// last `samples` sample intervals, and the run goes on: its packets are marked often
    /// enough that DCQCN cuts it at that cadence.
    fn cnp_cadence(&self, fl: &FlowState, samples: usize) -> Option<u64> {
        let a = &self.cfg.accel;
        let interval = self.cfg.dcqcn_params.cnp_interval.0;
        let last = fl.last_cnp?.0;
        let since = fl.cnp_run_since.0;
        let alive = self.now.0.saturating_sub(last) <= interval + interval / 10;
        let long = self.now.0.saturating_sub(since) >= samples as u64 * a.sample_interval.0;
        (a.cut_jumps && alive && long && fl.cnp_run > 0)
            .then(|| (last - since) / u64::from(fl.cnp_run))
    }

    fn try_jump(&mut self, ff: &mut FastForward) {
        let cfg = self.cfg;
        let a = &cfg.accel;
        let now = self.now;
        let mtu = u64::from(cfg.mtu_payload);
        let mut limit = u64::MAX;
        self.scheduled_releases();
        for &g in &self.rel_list {
            if let Some((t, _)) = self.pending_rel[g as usize] {
                limit = limit.min(t.0.saturating_sub(now.0));
            }
        }
        // Memoized flows finish at fixed global times and release their dependents then,
        // like pending releases.
        limit = limit.min(self.memo_horizon());
        let mut rates = Vec::with_capacity(ff.active.len());
        let mut horizon = Picos::ZERO;
        let mut cut_recently = false;
        for &f in &ff.active {
            let i = f as usize;
            // The whole-network jump keeps every clock in local time, so a recovering
            // flow's increase would come late by the jump: such a flow is not steady here,
            // nor is one being cut (cut jumps are the partitioned jump's).
            let Ok(Steady {
                rate,
                t_left,
                recovering_until: None,
                cut_in_window,
                cutting: None,
            }) = self.steady_rate(ff, i, ff.samples, ff.window, ff.since_change - 1, false)
            else {
                return;
            };
            limit = limit.min(t_left.0.saturating_sub(a.tail_margin.0));
            horizon = horizon.max(t_left);
            cut_recently |= cut_in_window;
            rates.push(rate);
        }
        let ports = 0..self.ports.len() as u32;
        if !self.queues_steady(ff, ports, ff.window, horizon, cut_recently) {
            return;
        }
        if limit < a.min_jump.0 || limit == u64::MAX {
            return;
        }
        // The jump moves flows' packets and clocks: it starts from the eager state.
        self.settle_dormant_frees();
        let jump = Picos(limit);
        let secs = jump.as_secs_f64();
        let mut moved = 0u64;
        for (j, &rate) in rates.iter().enumerate() {
            let f = ff.active[j] as usize;
            moved += self.advance_flow(ff, f, rate * secs);
        }
        if moved > 0 {
            self.renumber_packets(ff);
            for &f in &ff.active {
                ff.shift[f as usize] = 0;
            }
        }
        // The jump: global time moves, local time and pending events stay; releases keep
        // their global times.
        self.offset = Picos(self.offset.0 + jump.0);
        // In flow order, as the queue's order among equal times is the order of scheduling:
        // `rel_list` is still the sorted list of pending releases made above (nothing was
        // released or scheduled since; no flow finishes inside a jump).
        let pending = std::mem::take(&mut self.rel_list);
        for &g in &pending {
            let slot = &mut self.pending_rel[g as usize];
            if let Some((t, key)) = *slot {
                let at = Picos(t.0 - jump.0);
                *slot = self.q.reschedule(key, at).map(|k| (at, k));
            }
        }
        self.rel_list = pending;
        if let Some(m) = self.memo.as_mut() {
            if m.owned > 0 {
                for slot in m.finish_at.iter_mut() {
                    if let Some((t, key)) = *slot {
                        let at = Picos(t.0 - jump.0);
                        *slot = self.q.reschedule(key, at).map(|k| (at, k));
                    }
                }
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

/// Gives packet `pk` its flow's moved numbering (see [`Engine::renumber_packets`]).
fn renumber(ff: &mut FastForward, pk: &mut super::engine::Packet) {
    let i = pk.flow as usize;
    let mut k = ff.shift[i];
    let carry = ff.carry[i];
    if carry != 0 && pk.kind == Kind::Data && pk.hop < ff.carry_hop[i] {
        if carry > 0 {
            ff.carry_first[i] = ff.carry_first[i].min(pk.seq);
        }
        // A sender moves back by no more than it moved on (`carry_sender`).
        k = k.saturating_add_signed(carry);
    }
    if k > 0 && pk.kind != Kind::Cnp {
        pk.seq += k;
    }
}

/// Marks the links of flow `fl` (both directions) as changed at sample count `at`.
fn stamp(p: &mut Parts, paths: &[u32], fl: &FlowState, at: u64) {
    for (start, len) in [fl.fwd, fl.rev] {
        for h in start..start + len {
            p.link_stamp[paths[h as usize] as usize] = at;
        }
    }
}

/// One partition at a sample: its id in [`Partitions`] and its member flows.
struct Group {
    part: u32,
    flows: Vec<u32>,
}

impl Engine<'_> {
    /// The links of flow `f`, data path then reverse path.
    pub(super) fn flow_links(&self, f: u32) -> impl Iterator<Item = u32> + '_ {
        super::engine::links_of(&self.flows, &self.paths, f)
    }

    /// The partitioned fast-forward sample: recompute the partitions, record the delivered
    /// bytes of every flow not frozen by a jump, and jump each partition that is steady.
    fn ff_sample_parts(&mut self, ff: &mut FastForward) {
        let Some(mut p) = ff.parts.take() else {
            return;
        };
        let live = &self.live;
        p.draining.retain(|&f| live[f as usize] > 0);
        if !ff.active.is_empty() || !p.draining.is_empty() {
            self.scheduled_releases();
            let groups = self.partitions(ff, &mut p);
            let w = ff.window;
            let q = self.cfg.accel.quiet_window.min(w);
            for g in &groups {
                if p.link_stamp_hit(g.part, ff.samples) {
                    for &f in &g.flows {
                        p.fresh[f as usize] = 0;
                        p.quiet[f as usize] = 0;
                    }
                }
                if g.flows
                    .iter()
                    .any(|&f| p.frozen_until[f as usize] >= self.now)
                {
                    continue;
                }
                for &l in p.parts.links(g.part) {
                    let port = &self.ports[l as usize];
                    if port.from_switch {
                        ff.record_queue(l as usize, port.queued);
                    }
                }
                let quiet_now = q > 0 && self.partition_quiet(&p, g);
                let mut ready = true;
                let mut ready_quiet = quiet_now;
                let mut draining = false;
                for &f in &g.flows {
                    let i = f as usize;
                    if ff.active_pos[i] == NONE {
                        draining = true;
                        ready = false;
                        ready_quiet = false;
                        continue;
                    }
                    ff.record_sample(i, p.nsamp[i], &self.flows[i]);
                    p.nsamp[i] += 1;
                    p.fresh[i] += 1;
                    p.quiet[i] = if quiet_now { p.quiet[i] + 1 } else { 0 };
                    ready &= p.fresh[i] > w as u64;
                    // The quiet samples must all be fresh ones too; the first fresh sample
                    // still covers a stretch from before the change.
                    ready_quiet &= p.fresh[i] > q as u64 && p.quiet[i] >= q as u64;
                }
                // The quiet window's attempt first and, if it did not jump, the long
                // window's. A sample that jumped in neither counts under the test that held
                // back the first attempt made.
                let quiet_try = ready_quiet.then(|| self.try_jump_group(ff, &mut p, g, q, true));
                let long_try = (ready && quiet_try != Some(Ok(())))
                    .then(|| self.try_jump_group(ff, &mut p, g, w, false));
                let held = match (quiet_try, long_try) {
                    (Some(Ok(())), _) | (_, Some(Ok(()))) => HeldBy::Jumped,
                    (Some(Err(by)), _) | (None, Some(Err(by))) => by,
                    (None, None) if draining => HeldBy::Draining,
                    (None, None) if quiet_now => HeldBy::Settling,
                    (None, None) => HeldBy::Busy,
                };
                self.stats.ff_held.add(held, g.flows.len() as u64);
            }
            ff.samples += 1;
            if self.unfinished > 0 && self.pending_beyond(self.trace_pending()) {
                ff.pending = true;
                let at = Picos(self.now.0.saturating_add(self.cfg.accel.sample_interval.0));
                self.q.schedule(at, Ev::FfSample);
            }
        }
        ff.parts = Some(p);
    }

    /// The partitions of the active and draining flows ([`Partitions`], updated with this
    /// sample's members), and the earliest pending release touching each, left in
    /// `p.rel_limit` by partition id.
    fn partitions(&self, ff: &FastForward, p: &mut Parts) -> Vec<Group> {
        // A flow listed twice (never expected: a finished flow is not active) is taken once.
        let members: Vec<u32> = ff.active.iter().chain(&p.draining).copied().collect();
        let (flows, paths) = (&self.flows, &self.paths);
        p.parts
            .update(&members, |f| super::engine::links_of(flows, paths, f));
        let groups: Vec<Group> = p
            .parts
            .listing()
            .into_iter()
            .map(|part| Group {
                part,
                flows: p.parts.flows(part).to_vec(),
            })
            .collect();
        p.rel_limit.clear();
        p.rel_limit.resize(p.parts.id_bound(), u64::MAX);
        // Pending releases: the partitions their links would join.
        for (l, dt) in self.pending_release_links() {
            if let Some(part) = p.parts.of_link(l) {
                let x = &mut p.rel_limit[part as usize];
                *x = (*x).min(dt);
            }
        }
        // The slow path it replaces, checked in every debug run (the tests'): the
        // partitions (flows and links) and release limits recomputed from every
        // member's links.
        #[cfg(debug_assertions)]
        {
            let mut members = members;
            members.sort_unstable();
            members.dedup();
            let by_scan = self.partitions_by_scan(&members);
            let incremental: Vec<(Vec<u32>, Vec<u32>, u64)> = groups
                .iter()
                .map(|g| {
                    let mut links = p.parts.links(g.part).to_vec();
                    links.sort_unstable();
                    (g.flows.clone(), links, p.rel_limit[g.part as usize])
                })
                .collect();
            debug_assert_eq!(incremental, by_scan, "incremental partitions differ");
        }
        groups
    }

    /// Every link of every pending release, with the time from now to that release.
    fn pending_release_links(&self) -> impl Iterator<Item = (u32, u64)> + '_ {
        let now = self.now.0;
        self.rel_list.iter().flat_map(move |&g| {
            let due = self.pending_rel[g as usize].map(|(t, _)| t.0.saturating_sub(now));
            due.into_iter()
                .flat_map(move |dt| self.flow_links(g).map(move |l| (l, dt)))
        })
    }

    /// Every partition's flows, links and release limit, recomputed from scratch (a union-find
    /// over the links of `members`), in the order of [`Partitions::listing`]: the slow
    /// path of [`Engine::partitions`], for debug checks.
    #[cfg(debug_assertions)]
    fn partitions_by_scan(&self, members: &[u32]) -> Vec<(Vec<u32>, Vec<u32>, u64)> {
        let mut uf: Vec<u32> = (0..self.ports.len() as u32).collect();
        let (flows, paths) = (&self.flows, &self.paths);
        let keyed = components(&mut uf, members, &|f| {
            super::engine::links_of(flows, paths, f)
        });
        let mut groups: Vec<(u32, Vec<u32>, u64)> = Vec::new();
        for (root, f) in keyed {
            match groups.last_mut() {
                Some(g) if g.0 == root => g.1.push(f),
                _ => groups.push((root, vec![f], u64::MAX)),
            }
        }
        for (l, dt) in self.pending_release_links() {
            let r = find(&mut uf, l);
            if let Ok(k) = groups.binary_search_by_key(&r, |g| g.0) {
                groups[k].2 = groups[k].2.min(dt);
            }
        }
        groups
            .into_iter()
            .map(|(_, flows, lim)| {
                let mut links: Vec<u32> = flows.iter().flat_map(|&f| self.flow_links(f)).collect();
                links.sort_unstable();
                links.dedup();
                (flows, links, lim)
            })
            .collect()
    }

    /// Whether the switch egress queues of `links` are steady over their last `span`
    /// samples, for a jump whose flows have at most `horizon` left to run.
    ///
    /// A jump freezes every queue, so it stands for the run it skips only if what the
    /// queues would have done meanwhile does not matter. A queue's *drift* is the
    /// difference between the means of the second and the first half of its samples, over
    /// the time between the halves' middles: a queue that keeps growing (a port that
    /// carries a flow at its sender's line rate and, beside it, the ACKs of another, or
    /// senders slightly above its speed) drifts by the excess, one oscillating about a
    /// level (DCQCN holding it there) by little. With DCQCN:
    /// - a queue at or under its ECN threshold (`kmin`) that drifts up and would reach it
    ///   within `horizon` is not steady: the jump would postpone the first mark by its own
    ///   length, and the rate cuts with it (a bounded jump would not do: the queue,
    ///   frozen, is as far from the threshold after it as before). One that would not
    ///   reach it stays under `kmin`, which bounds the latency the jump leaves out; its
    ///   growth changes no completion where it is the flows' bottleneck, as they
    ///   complete at the rate it serves them.
    /// - a queue over `kmin` is not steady if it drifts by more than `queue_theta` of its
    ///   link's speed (DCQCN has not brought its senders to its speed yet), nor while none
    ///   of the flows (`cut_recently`) has had its rate cut within the window: the jump
    ///   leaves out the marks of the packets it moves, which DCQCN's equilibrium can do
    ///   without (each mark a small cut, the rate holding on average), but for flows no
    ///   mark has reached yet the first is a cut of up to half their rate. The drift bound
    ///   has never been what refused a jump in the equivalence tests, the pinned bench
    ///   rows or the ECMP GPT 350M step on 512 GPUs (a temporary count, 2026-12-06): once
    ///   every flow has passed [`Engine::steady_rate`] (its DCQCN rate within `rate_theta`
    ///   over the window), no queue over its threshold was found drifting by more. It
    ///   stays as the guard for a looser `rate_theta`, and has no test that fails without
    ///   it.
    ///
    /// Without DCQCN nothing is marked and a queue is steady when its drift is within
    /// `queue_theta` of its link's speed (PFC holds a growing one at its pause threshold).
    /// An infinite `queue_theta` leaves queues out of the test (the model before it).
    fn queues_steady(
        &self,
        ff: &FastForward,
        links: impl Iterator<Item = u32>,
        span: usize,
        horizon: Picos,
        cut_recently: bool,
    ) -> bool {
        let a = &self.cfg.accel;
        let w = ff.window;
        let half = (span.min(w) / 2) as u64;
        if half == 0 || a.queue_theta == f64::INFINITY {
            return true;
        }
        let between = half as f64 * a.sample_interval.as_secs_f64();
        links.into_iter().all(|l| {
            let port = &self.ports[l as usize];
            if !port.from_switch {
                return true;
            }
            let n = ff.link_samples[l as usize];
            if n < 2 * half {
                return false;
            }
            let at = |k: u64| ff.queue_sample(l, k);
            let recent: u64 = (1..=half).map(at).sum();
            let older: u64 = (half + 1..=2 * half).map(at).sum();
            let drift = (recent as f64 - older as f64) / half as f64 / between;
            let queued = port.queued as f64;
            if !self.cfg.dcqcn {
                drift.abs() <= a.queue_theta * port.bw
            } else if queued <= port.ecn.kmin {
                drift <= 0.0 || (port.ecn.kmin - queued) / drift >= horizon.as_secs_f64()
            } else {
                cut_recently && drift.abs() <= a.queue_theta * port.bw
            }
        })
    }

    /// Whether partition `g` is *quiet* now (`accel.quiet_window`): no switch egress queue
    /// on its links holds enough bytes to be ECN-marked, none of its ports is paused or
    /// has paused its upstream, and, with DCQCN, no flow of it has a rate cut waiting for
    /// its decrease period. Such a partition's flows are held back by nothing but their
    /// senders' ports (shared round-robin among a fixed set of queue pairs), DCQCN rates
    /// and the FIFOs serving them; the rates change only at a recovering flow's next
    /// increase (where [`Engine::steady_rate`] stops the jump) or when a queue reaches its
    /// threshold (which [`Engine::calm_queues`] keeps the jump short of) until a flow
    /// starts or ends.
    fn partition_quiet(&self, p: &Parts, g: &Group) -> bool {
        let ports_quiet = p.parts.links(g.part).iter().all(|&l| {
            let port = &self.ports[l as usize];
            !port.paused
                && !port.pause_sent
                && (!port.from_switch || port.ecn.probability(port.queued as f64) == 0.0)
        });
        ports_quiet
            && (!self.cfg.dcqcn
                || g.flows
                    .iter()
                    .all(|&f| self.flows[f as usize].rp.rate_held()))
    }

    /// Jumps partition `g` if every flow of it is steady over its last `span` samples: like
    /// [`Engine::try_jump`] for its flows only, stopping at the next release touching it,
    /// and postponing all its pending events and kept times by the jump so it stays frozen
    /// meanwhile. A `quiet` partition (see [`Engine::partition_quiet`]) stops
    /// `quiet_tail_margin` before a completion instead of `tail_margin`. Returns the
    /// test that held it back if it did not jump.
    fn try_jump_group(
        &mut self,
        ff: &mut FastForward,
        p: &mut Parts,
        g: &Group,
        span: usize,
        quiet: bool,
    ) -> Result<(), HeldBy> {
        let cfg = self.cfg;
        let a = &cfg.accel;
        let now = self.now;
        let mtu = u64::from(cfg.mtu_payload);
        // A memoized flow finishing releases flows nobody announced yet, which could reach
        // this partition while it is frozen: never jump past one.
        let mut limit = p.rel_limit[g.part as usize].min(self.memo_horizon());
        let mut rates = Vec::with_capacity(g.flows.len());
        let mut horizon = Picos::ZERO;
        let mut earliest = Picos(u64::MAX);
        let mut cut_recently = false;
        let mut recovering = Vec::with_capacity(g.flows.len());
        let mut cutting = Vec::with_capacity(g.flows.len());
        for &f in &g.flows {
            let i = f as usize;
            // The samples since the partition last changed, the first of which still
            // covers a stretch from before; quiet ones, for a quiet jump.
            let fresh = p.fresh[i].saturating_sub(1);
            let avail = if quiet { fresh.min(p.quiet[i]) } else { fresh };
            let st = self.steady_rate(ff, i, p.nsamp[i], span, avail, quiet)?;
            earliest = earliest.min(st.t_left);
            horizon = horizon.max(st.t_left);
            cut_recently |= st.cut_in_window;
            if let Some(t) = st.recovering_until {
                // Its rate holds until the increase timer fires, which keeps its own
                // time through the jump.
                limit = limit.min(t.0.saturating_sub(now.0));
            }
            rates.push(st.rate);
            recovering.push(st.recovering_until.is_some());
            cutting.push(st.cutting);
        }
        // A quiet partition's queues were under their ECN thresholds at every sample
        // tested; where they stand deeper than a frame, the jump's tail margin grows by
        // the time the deepest takes to drain, and a queue growing towards its threshold
        // is carried (`carry` module).
        let mut queues = Vec::new();
        let mut tail_margin = a.tail_margin;
        let links = p.parts.links(g.part).iter().copied();
        if quiet {
            // The queues' drifts are measured over the samples at which the partition
            // was quiet in a row (up to the window), the quiet window's at least.
            let quiet_run = g.flows.iter().map(|&f| p.quiet[f as usize]).min();
            let queue_span = quiet_run.map_or(span, |n| (n as usize).clamp(span, ff.window));
            let calm = self.calm_queues(ff, links, queue_span, horizon, &g.flows, &rates)?;
            tail_margin = Picos(a.quiet_tail_margin.0 + calm.drain.0);
            limit = limit.min(calm.limit);
            queues = calm.queues;
        } else if !self.queues_steady(ff, links, span, horizon, cut_recently) {
            return Err(HeldBy::QueueDrifting);
        }
        let before_completion = earliest.0.saturating_sub(tail_margin.0);
        limit = limit.min(before_completion);
        // A cutting flow's rate falls a CNP's cut at a time: the jump stops before it comes
        // within `theta` of what the flow delivers, or where its increase timer would fire.
        let mut trains: Vec<Option<CnpTrain>> = Vec::with_capacity(g.flows.len());
        for (k, &f) in g.flows.iter().enumerate() {
            let Some(period) = cutting[k] else {
                trains.push(None);
                continue;
            };
            let train = self.cnp_train(f, period);
            let mut rp = self.flows[f as usize].rp.clone();
            let floor = (1.0 + a.theta) * rates[k];
            let until = Picos(now.0.saturating_add(limit));
            let mut arrivals = train.arrivals(now);
            if let Some(t) = rp.drive(&mut arrivals, until, floor, &cfg.dcqcn_params) {
                limit = limit.min(t.0.saturating_sub(now.0));
            }
            trains.push(Some(train));
        }
        if limit == u64::MAX {
            return Err(HeldBy::OtherBoundNear);
        }
        // Nor past the earliest a flow nobody announced yet could land on it.
        let limit = self.unannounced_release_bound(ff, p, g.part, limit);
        // Whole sample intervals, so the partition thaws on a sample and its next sample
        // covers a full interval.
        let iv = a.sample_interval.0.max(1);
        let limit = limit / iv * iv;
        if limit < a.min_jump.0 || limit == 0 {
            // Which bound held it: the completion's, or a release's, an increase's or a
            // memoized episode's.
            return Err(if before_completion / iv * iv == limit {
                HeldBy::CompletionNear
            } else {
                HeldBy::OtherBoundNear
            });
        }
        let jump = Picos(limit);
        let mut carried = if queues.is_empty() {
            Vec::new()
        } else {
            match self.plan_carry(&queues, &g.flows, &rates, jump) {
                Some(c) => c,
                None => return Err(HeldBy::QueueAtItsLimit),
            }
        };
        // The jump postpones the partition's pending port events, dormant frees included.
        self.settle_dormant_frees();
        let secs = jump.as_secs_f64();
        let mut moved = 0u64;
        let until = Picos(now.0 + jump.0);
        for (k, ((&f, &rate), &keeps_clock)) in
            g.flows.iter().zip(&rates).zip(&recovering).enumerate()
        {
            let i = f as usize;
            p.in_group[i] = true;
            p.keeps_clock[i] = keeps_clock;
            p.frozen_until[i] = Picos(now.0 + jump.0);
            let fl = &mut self.flows[i];
            // Every time the flow keeps moves with its events.
            fl.ready_at = Picos(fl.ready_at.0 + jump.0);
            fl.last_progress = Picos(fl.last_progress.0 + jump.0);
            // The flow's clock stops with its partition: its delivery point moves with it.
            fl.delivered_at = Picos(fl.delivered_at.0 + jump.0);
            ff.jumped_time[i] = Picos(ff.jumped_time[i].0 + jump.0);
            if let Some(train) = &trains[k] {
                // A cutting flow's DCQCN state lives through the jump instead, taking the
                // CNPs it would have taken (the jump stopped before its rate could
                // matter); its receiver sent the last of them, its run going on, and
                // without one its clock stands.
                p.cutting[i] = true;
                let _ = fl
                    .rp
                    .drive(&mut train.arrivals(now), until, 0.0, &cfg.dcqcn_params);
                let (sent, last) = train.sent_during(now, until);
                fl.cnp_run += sent;
                fl.last_cnp = last.or(fl.last_cnp);
            } else {
                fl.last_cnp = fl.last_cnp.map(|t| Picos(t.0 + jump.0));
                fl.cnp_run_since = Picos(fl.cnp_run_since.0 + jump.0);
                if !keeps_clock {
                    fl.rp.shift(jump);
                }
            }
            moved += self.advance_flow(ff, i, rate * secs);
        }
        let (mut appended, mut taken) = (0, 0);
        for c in carried.iter_mut() {
            let draining = queues[c.queue].drift < 0.0;
            let signed = if draining {
                -(c.packets as i64)
            } else {
                c.packets as i64
            };
            c.packets = self.carry_sender(ff, c.flow as usize, c.hop, signed);
            if draining {
                taken += c.packets;
            } else {
                appended += c.packets;
            }
        }
        // The partition's pending events, in ledger (scheduling) order: its packets in
        // flight are among them, and all of them are postponed below.
        let mut positions = self.group_positions(p, g, 0);
        let (gen, collected) = (self.ledger_gen, self.ledger.as_ref().map_or(0, Vec::len));
        if moved > 0 || appended > 0 || taken > 0 {
            self.renumber_group_packets(ff, p.parts.links(g.part), &positions);
        }
        if appended > 0 || taken > 0 {
            let before: Vec<u64> = queues
                .iter()
                .map(|q| self.ports[q.link as usize].queued)
                .collect();
            self.append_carried(ff, &queues, &carried);
            self.take_drained(&queues, &carried);
            // A queue's samples, like its flows', are kept in its partition's own time
            // (a frozen partition records none): what the jump carried into or out of it
            // goes into its earlier samples too, so its course is measured on through
            // the jump instead of from the thaw.
            for (q, before) in queues.iter().zip(before) {
                let after = self.ports[q.link as usize].queued;
                ff.shift_queue_history(q.link as usize, after as i64 - before as i64);
            }
            for c in &carried {
                ff.carry[c.flow as usize] = 0;
            }
            self.stats.carried_packets += appended;
            self.stats.drained_packets += taken;
        }
        // What the carried queues scheduled since is the partition's too (and a
        // compaction since has moved every position).
        if self.ledger_gen != gen {
            positions = self.group_positions(p, g, 0);
        } else {
            positions.extend(self.group_positions(p, g, collected));
        }
        // Postpone them by the jump, in their scheduling order so ties keep their order.
        // Entries are rewritten in place: positions, and the captures' index of them
        // (`LedgerIndex`), stay valid.
        let mut ledger = self.ledger.take().unwrap_or_default();
        for &i in &positions {
            let e = &mut ledger[i as usize];
            if let Ev::RpDecrease(f) | Ev::RpIncrease(f) = e.2 {
                if p.cutting[f as usize] {
                    // Its DCQCN clocks lived through the jump: rescheduled below.
                    self.q.cancel(e.0);
                    continue;
                }
            }
            let at = Picos(e.1 .0 + jump.0);
            if let Some(key) = self.q.reschedule(e.0, at) {
                *e = (key, at, e.2);
                if let Ev::PortWake(l) = e.2 {
                    self.ports[l as usize].wake = Some((at, key));
                }
            }
        }
        self.ledger = Some(ledger);
        for &f in &g.flows {
            let i = f as usize;
            if p.cutting[i] {
                let rp = &self.flows[i].rp;
                let (tick, timer) = (rp.pending_decrease(), rp.next_increase());
                if let Some(t) = tick {
                    self.sched(t, Ev::RpDecrease(f));
                }
                if let Some(t) = timer {
                    self.sched(t, Ev::RpIncrease(f));
                }
            }
            ff.shift[i] = 0;
            p.in_group[i] = false;
            p.keeps_clock[i] = false;
            p.cutting[i] = false;
        }
        let st = &mut self.stats;
        st.fast_forwards += 1;
        st.recovering_jumps += u64::from(recovering.contains(&true));
        st.quiet_jumps += u64::from(quiet);
        st.cut_jumps += u64::from(trains.iter().any(Option::is_some));
        st.jumped_time = Picos(st.jumped_time.0 + jump.0);
        st.skipped_packets += moved;
        st.skipped_bytes += moved * mtu;
        if self.data_packets > 0 {
            let per_packet = self.events as f64 / self.data_packets as f64;
            st.skipped_events += (moved as f64 * per_packet).round() as u64;
        }
        Ok(())
    }
}

impl Engine<'_> {
    /// The ledger positions, from `from` on, of partition `g`'s pending events that its
    /// jump moves: its flows' packets and timers (not a recovering flow's rate increase,
    /// whose clock keeps its own time) and its links' port events, and a cutting flow's
    /// DCQCN ticks, which the jump cancels and schedules anew.
    fn group_positions(&mut self, p: &Parts, g: &Group, from: usize) -> Vec<u32> {
        // From the start, the index of the ledger by owner narrows the visit to the
        // partition's own events (and those scheduled since the index was built).
        let candidates = if from == 0 {
            self.owned_positions(&g.flows, p.parts.links(g.part))
        } else {
            None
        };
        let ledger = self.ledger.as_deref().unwrap_or(&[]);
        let moved = |ev: Ev| {
            if let Ev::RpDecrease(f) | Ev::RpIncrease(f) = ev {
                if p.cutting[f as usize] {
                    return true;
                }
            }
            match owner_of(&self.pkts, ev) {
                Some(Owner::Flow(f)) => {
                    p.in_group[f as usize]
                        && !(p.keeps_clock[f as usize] && matches!(ev, Ev::RpIncrease(_)))
                }
                Some(Owner::Link(l)) => p.parts.of_link(l) == Some(g.part),
                None => false,
            }
        };
        let pending_and_moved = |i: &u32| {
            let e = &ledger[*i as usize];
            self.q.contains(e.0) && moved(e.2)
        };
        match candidates {
            Some(at) => at.into_iter().filter(pending_and_moved).collect(),
            None => (from as u32..ledger.len() as u32)
                .filter(pending_and_moved)
                .collect(),
        }
    }

    /// The least time `t < limit` from now at which a release not scheduled yet could land
    /// on a link of partition `part`, or `limit` if none can come sooner.
    ///
    /// Releases are scheduled when a flow's last dependency finishes, so a jump of `part`
    /// planned now would not see one that a flow of *another* partition triggers by
    /// finishing while `part` is frozen: the new flow would then meet `part`'s frozen
    /// ports and wait for the thaw (a ring step of a staggered ring, released 2.5 us into a
    /// 110 us jump of its neighbour's partition, took 348 us instead of 189). This bounds
    /// every such release from below, through chains of flows not released yet, by a
    /// shortest-path search in time: an active flow outside `part` finishes no sooner than
    /// its undelivered packets take at its slowest link's speed (after its thaw, if a jump
    /// froze it); a flow whose release is scheduled, at that time; a dependent is released
    /// no sooner than that plus its delay, and finishes no sooner than its own packets take
    /// at its slowest link's speed. The search stops at `limit`. Memoized and virtual flows
    /// finish at known times, and jumps never pass the first of those
    /// ([`Engine::memo_horizon`]), so they need no search.
    fn unannounced_release_bound(&self, ff: &FastForward, p: &Parts, part: u32, limit: u64) -> u64 {
        use std::cmp::Reverse;
        use std::collections::{BinaryHeap, HashMap};
        let now = self.now.0;
        let mtu = f64::from(self.cfg.mtu_payload);
        // Seconds to picoseconds, rounded down so a bound stays a bound.
        let at_line = |f: u32, packets: u64| -> u64 {
            let fl = &self.flows[f as usize];
            let slowest = (fl.fwd.0..fl.fwd.0 + fl.fwd.1)
                .map(|h| self.ports[self.paths[h as usize] as usize].bw)
                .fold(f64::INFINITY, f64::min);
            (packets as f64 * mtu / slowest * 1e12) as u64
        };
        // Earliest finish of each flow reached, from now.
        let mut best: HashMap<u32, u64> = HashMap::new();
        let mut heap = BinaryHeap::new();
        for &f in &ff.active {
            let i = f as usize;
            if p.parts.of_flow(f) == Some(part) {
                continue; // frozen with the partition: it cannot finish during the jump
            }
            let fl = &self.flows[i];
            let thaw = p.frozen_until[i].0.saturating_sub(now);
            let t = thaw.saturating_add(at_line(f, fl.npkts.saturating_sub(fl.rcv_nxt + 1)));
            if t < limit {
                best.insert(f, t);
                heap.push(Reverse((t, f)));
            }
        }
        for &f in &self.rel_list {
            if let Some((at, _)) = self.pending_rel[f as usize] {
                let t =
                    at.0.saturating_sub(now)
                        .saturating_add(at_line(f, self.flows[f as usize].npkts.saturating_sub(1)));
                if t < limit {
                    best.insert(f, t);
                    heap.push(Reverse((t, f)));
                }
            }
        }
        let mut bound = limit;
        while let Some(Reverse((t, f))) = heap.pop() {
            if t >= bound {
                break;
            }
            if best.get(&f).is_some_and(|&b| b < t) {
                continue;
            }
            let range = self.dependents_at[f as usize] as usize
                ..self.dependents_at[f as usize + 1] as usize;
            for &d in &self.dependents[range] {
                let dl = &self.flows[d as usize];
                if dl.released || self.pending_rel[d as usize].is_some() {
                    continue; // running, or its release is already announced
                }
                let release = t.saturating_add(dl.delay.0);
                if release >= bound {
                    continue;
                }
                if self.flow_links(d).any(|l| p.parts.of_link(l) == Some(part)) {
                    bound = release;
                    continue;
                }
                let done = release.saturating_add(at_line(d, dl.npkts.saturating_sub(1)));
                if done < bound && best.get(&d).is_none_or(|&b| done < b) {
                    best.insert(d, done);
                    heap.push(Reverse((done, d)));
                }
            }
        }
        bound
    }

    /// Time from now to the earliest pending completion of a memoized flow (`u64::MAX`
    /// if none).
    fn memo_horizon(&self) -> u64 {
        let now = self.now.0;
        match self.memo.as_ref() {
            Some(m) if m.owned > 0 => m
                .finish_at
                .iter()
                .flatten()
                .map(|&(t, _)| t.0.saturating_sub(now))
                .min()
                .unwrap_or(u64::MAX),
            _ => u64::MAX,
        }
    }
}

impl Parts {
    /// Whether a link of partition `part` changed since the last sample (count
    /// `samples`): its links are exactly its flows' links.
    fn link_stamp_hit(&self, part: u32, samples: u64) -> bool {
        self.parts
            .links(part)
            .iter()
            .any(|&l| self.link_stamp[l as usize] == samples)
    }
}
