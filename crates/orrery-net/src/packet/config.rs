//! Settings of the packet-level model: every field, its default and where the default comes
//! from. The module essay in [`crate::packet`] explains how each mechanism uses them.

use orrery_units::{Bandwidth, Picos};
use serde::{Deserialize, Serialize};

/// One point of the ECN marking table: RED-style thresholds for links of `gbps`.
///
/// Thresholds for other link speeds are interpolated (see [`PacketConfig::ecn_for`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EcnPoint {
    /// Link speed this point is for, in Gb/s.
    pub gbps: f64,
    /// Egress queue length (bytes) at or below which nothing is marked.
    pub kmin: u64,
    /// Egress queue length (bytes) above which every packet is marked.
    pub kmax: u64,
    /// Marking probability reached just below `kmax` (linear from 0 at `kmin`).
    pub pmax: f64,
}

/// The RED/ECN thresholds that apply to one egress port.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EcnThresholds {
    pub kmin: f64,
    pub kmax: f64,
    pub pmax: f64,
}

impl EcnThresholds {
    /// Marking probability at egress queue length `queue` bytes.
    pub fn probability(&self, queue: f64) -> f64 {
        if queue <= self.kmin {
            0.0
        } else if queue > self.kmax {
            1.0
        } else if self.kmax > self.kmin {
            self.pmax * (queue - self.kmin) / (self.kmax - self.kmin)
        } else {
            1.0
        }
    }
}

/// DCQCN reaction-point (sender) and notification-point (receiver) parameters.
///
/// Defaults are the ones the RDMA simulation literature uses for Mellanox/NVIDIA ConnectX
/// NICs in ns-3 (the HPCC simulator's `mlx` DCQCN, as listed in the issue): they are not
/// tuned to any measurement here.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DcqcnParams {
    /// Rate-increase timer period: every period without a rate decrease brings one
    /// increase event (fast recovery, then additive, then hyper increase).
    /// Default 900 us (ns-3 HPCC `RP_TIMER`).
    pub rate_increase_timer: Picos,
    /// Period of the alpha update: `alpha = (1 - g) * alpha (+ g if a CNP arrived in the
    /// period)`. Default 1 us (`ALPHA_RESUME_INTERVAL`).
    pub alpha_update_interval: Picos,
    /// Period at which a pending CNP is turned into a rate decrease (at most one decrease
    /// per period). Default 4 us (`RATE_DECREASE_INTERVAL`).
    pub rate_decrease_interval: Picos,
    /// EWMA gain of alpha. Default 1/256 (`EWMA_GAIN` = 0.00390625).
    pub g: f64,
    /// Additive increase of the target rate per increase event after fast recovery.
    /// Default 50 Mb/s (`RATE_AI`).
    pub additive_increase: Bandwidth,
    /// Hyper increase of the target rate per increase event in the hyper stage.
    /// Default 100 Mb/s (`RATE_HAI`).
    pub hyper_increase: Bandwidth,
    /// Lowest rate a decrease may reach. Default 100 Mb/s (`MIN_RATE`).
    pub min_rate: Bandwidth,
    /// Number of fast-recovery increase events (rate halves its distance to the target)
    /// before additive increase starts. Default 1 (`FAST_RECOVERY_TIMES`).
    pub fast_recovery_stages: u32,
    /// Whether every decrease also resets the target rate to the current rate (otherwise
    /// only decreases that interrupt an increase phase do). Default false
    /// (`CLAMP_TARGET_RATE 0`).
    pub clamp_target_rate: bool,
    /// Alpha set at the first CNP a queue pair receives. Default 1.0 (ns-3 `mlx`).
    pub initial_alpha: f64,
    /// Notification point: a receiver sends at most one CNP per flow per this interval,
    /// when ECN-marked packets of the flow arrive. Default 50 us (the DCQCN paper's `N`,
    /// the ConnectX `min_time_between_cnps` default).
    pub cnp_interval: Picos,
}

impl Default for DcqcnParams {
    fn default() -> Self {
        DcqcnParams {
            rate_increase_timer: Picos::from_micros(900),
            alpha_update_interval: Picos::from_micros(1),
            rate_decrease_interval: Picos::from_micros(4),
            g: 1.0 / 256.0,
            additive_increase: Bandwidth::from_gbits_per_sec(0.05),
            hyper_increase: Bandwidth::from_gbits_per_sec(0.1),
            min_rate: Bandwidth::from_gbits_per_sec(0.1),
            fast_recovery_stages: 1,
            clamp_target_rate: false,
            initial_alpha: 1.0,
            cnp_interval: Picos::from_micros(50),
        }
    }
}

/// Settings of the packet-level simulator. Every field has a documented default; a TOML or
/// JSON table may give any subset of them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PacketConfig {
    /// Payload bytes per data packet (the last packet of a flow carries the rest).
    /// Default 1000 B: the payload size of the ns-3 RDMA simulators (HPCC, DCQCN studies),
    /// so results compare with published packet-level figures. (Real RoCE path MTUs are
    /// 1024 or 4096; set 4096 for a closer model of NCCL traffic at a quarter the events.)
    pub mtu_payload: u32,
    /// Header and trailer bytes per data packet, counted in buffers and on the wire.
    /// Default 62 B: RoCEv2 = Ethernet 14 + IPv4 20 + UDP 8 + InfiniBand BTH 12 + ICRC 4 +
    /// Ethernet FCS 4.
    pub header_bytes: u32,
    /// Bytes of line time per frame that are never buffered. Default 20 B: preamble and
    /// start delimiter 8 + minimum inter-frame gap 12. A 1000 B payload thus takes 1082 byte
    /// times: goodput is 92.4% of the line rate.
    pub framing_bytes: u32,
    /// Frame size of an ACK or NACK. Default 66 B: RoCEv2 headers + AETH 4.
    pub ack_bytes: u32,
    /// Frame size of a CNP. Default 78 B: RoCEv2 headers + 16 reserved bytes.
    pub cnp_bytes: u32,
    /// Frame size of a PFC pause/resume frame. Default 64 B (minimum Ethernet frame;
    /// IEEE 802.1Qbb).
    pub pfc_frame_bytes: u32,
    /// The receiver acknowledges every `ack_every`-th in-order packet (and always the last
    /// packet of a flow). Default 1: one ACK per packet, as the ns-3 simulators' default
    /// (`L2_ACK_INTERVAL 1`). Larger values model coalesced ACKs.
    pub ack_every: u32,
    /// Whether the receiver sends a NACK (RoCE "sequence error") for the first
    /// out-of-order packet after a gap, so the sender goes back at once instead of waiting
    /// for the timeout. Default true (RoCE go-back-N behaviour).
    pub nack: bool,
    /// Retransmission timeout: when nothing has been acknowledged for this long while
    /// packets are outstanding, the sender goes back to the first unacknowledged packet.
    /// Default 4 ms: above the worst queueing delay of one full default buffer (32 MiB at
    /// 100 Gb/s drains in 2.7 ms), so a lossless fabric never times out spuriously; close to
    /// the InfiniBand local ACK timeout 4.096 us * 2^10.
    pub rto: Picos,
    /// Consecutive timeouts without progress after which a queue pair gives up (its flow
    /// then never finishes and the simulation reports it unfinished). Default 7, the
    /// InfiniBand `retry_cnt` maximum.
    pub max_retries: u32,
    /// Shared buffer per switch, bytes. Default 32 MiB (the 32 MB; the ns-3 HPCC
    /// setups' `BUFFER_SIZE 32`).
    pub buffer_bytes: u64,
    /// Priority flow control on data. Default true (lossless RoCE). When false a switch
    /// drops a data packet that does not fit in its buffer (tail drop).
    pub pfc: bool,
    /// Dynamic-threshold factor: an ingress port pauses its upstream when its shared-buffer
    /// use exceeds `pfc_alpha * (free shared buffer)`. Default 1/8 (the ns-3 HPCC switch
    /// MMU's `pfc_a_shift = 3`, a common Broadcom setting).
    pub pfc_alpha: f64,
    /// Resume hysteresis: a paused ingress resumes when its shared use plus this is at most
    /// the threshold (or its use is zero) and its headroom is empty. Default 3072 B (ns-3
    /// HPCC MMU `resume_offset`).
    pub pfc_resume_offset: u64,
    /// Bytes of buffer guaranteed to every ingress port before it draws on the shared pool.
    /// Default 4096 B (ns-3 HPCC MMU `reserve`).
    pub pfc_reserve: u64,
    /// Headroom per ingress port, bytes: buffer kept back to absorb what is still in flight
    /// after a pause is sent. `None` (default) sizes it per link to
    /// `2 * bandwidth * delay + 3 * (MTU frame) + PFC frame` (line time), which covers the
    /// bytes on the wire both ways, the frame the upstream is sending when the pause
    /// arrives, the frame that crossed the threshold and the pause frame itself.
    pub pfc_headroom: Option<u64>,
    /// ECN marking table (RED at egress), by link speed. Default: 100 Gb/s: Kmin 400 KB,
    /// Kmax 1600 KB, Pmax 0.2; 400 Gb/s: 800 KB, 3200 KB, 0.2 (the values; KB =
    /// 1000 B as in the ns-3 `KMIN_MAP`/`KMAX_MAP`). See [`PacketConfig::ecn_for`] for
    /// other speeds.
    pub ecn: Vec<EcnPoint>,
    /// DCQCN congestion control (ECN marking at switches, CNPs from receivers, rate
    /// control at senders). Default true. When false senders always send at line rate and
    /// switches do not mark.
    pub dcqcn: bool,
    /// DCQCN parameters.
    pub dcqcn_params: DcqcnParams,
    /// Seed of the random numbers (ECN marking decisions). Default 0.
    pub seed: u64,
    /// Whether a port that starts a frame with nothing queued behind it (and, at a host,
    /// no queue pair with a packet left to send, paced or not) leaves its free *dormant*:
    /// the free keeps its place in the event order but is filed only if the port is given
    /// work before it (a frame queued, a queue pair started or sent back by a NACK or a
    /// timeout), and is dropped unseen otherwise. Exact: a run gives the same flows, bytes,
    /// pauses and drops either way (the tests compare them, lossy runs included), only
    /// fewer events are handled and counted. Default true, in the reference too, since it
    /// changes no answer (docs/benchmarks.md has what it saves). A host port whose queue
    /// pairs are only paced still schedules its free, which sets the port's wake-up.
    pub lazy_port_frees: bool,
    /// Acceleration (partitioning, steady-state fast-forwarding, memoization). On by
    /// default; [`PacketConfig::reference`] is the packet-by-packet reference with all of
    /// it off. See [`AccelConfig`].
    pub accel: AccelConfig,
}

/// Settings of the accelerated packet model (see the "Acceleration" section of
/// [`crate::packet`]).
///
/// Every `sample_interval` the simulator records each active flow's delivered bytes in that
/// interval; a flow is *steady* when its last `window` samples, all taken since the last
/// flow release or completion, have `(max - min) / mean < theta`. When every active flow
/// is steady the whole network jumps ahead (see [`crate::packet`] for what bounds a jump).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AccelConfig {
    /// Steady-state fast-forwarding. Default true: the equivalence harness
    /// (`tests/accel.rs`) holds the error bounds on its scenarios with each
    /// mechanism on and off. [`PacketConfig::reference`] turns all of them off.
    pub fast_forward: bool,
    /// Partitioning into independent groups of flows and links (with `fast_forward`): each
    /// connected component of the active flows and the links they use decides steadiness
    /// and jumps on its own, so an unsteady or short flow in one part of the network no
    /// longer blocks jumps elsewhere. Without `fast_forward` it does nothing. Default true
    /// (false: the whole network is one partition). See the `accel` module for the design.
    pub partitioning: bool,
    /// Memoization of isolated episodes: a group of flows released together onto idle
    /// links whose simulation is already in the cache is looked up instead of simulated
    /// (see the `memo` module). Default true.
    pub memoize: bool,
    /// Mirroring (with `memoize`): isomorphic groups that start at the same instant on
    /// disjoint idle links, such as the data-parallel rings of every pipeline stage and
    /// tensor rank, are simulated once; the others finish each flow when the simulated
    /// group's matching flow finishes (see the `memo` module). Default true.
    pub mirror: bool,
    /// Periodic extrapolation (with `memoize`): once every chain of a collective (a ring
    /// rank's flows to its successor, step after step) completes its flows in the same time
    /// to within `period_theta` over `period_window` steps, and nothing else uses its links,
    /// its further flows finish after that time without being simulated (see the
    /// `periodic` module). Default true.
    pub periodic: bool,
    /// Memoization of whole collectives (with `periodic`): a collective with chains that
    /// started on idle links, ran to its end with nothing else on them and went periodic
    /// leaves its flows' release offsets and completion times; a later collective of the
    /// same shape (endpoints, sizes, routes, dependencies among its flows and the delays
    /// after them) that starts on idle links, with every flow released from outside it due
    /// at its recorded offset, finishes each flow at the recorded time after its release,
    /// without packets, until another collective's flow meets one of its flows on a link
    /// (see "Repeated collectives" in the `periodic` module). Default true.
    pub collective_memo: bool,
    /// Symmetry reduction: when shifting every host (or every GPU of a host) to the next
    /// one of its block leaves the fabric, the flows and their routes unchanged (a ring
    /// over hosts that all do the same), only one copy of each orbit of flows is simulated
    /// and the others take its completion times (see the `symmetry` module). It changes
    /// single flows where the reference breaks ties between same-time events by flow
    /// number (about as much as renumbering the reference's flows does), and collective
    /// completions not at all on the rings measured. Default true.
    pub symmetry: bool,
    /// With `symmetry`: when no rotation maps every flow, try them again with the flows of
    /// at most one packet (`mtu_payload` bytes) left out of the check, as long as they are
    /// at most one per hundred packets. The tiny all-reduce of a gradient norm over a tree
    /// with a root is the case: it breaks every host shift of a training step and carries
    /// a few bytes. Exempt flows are simulated each on its own, folded onto the quotient's
    /// links, and the flows that wait for them are released when their own dependencies
    /// finish; a level whose late flows come out of step with their copies is set aside
    /// and searched again without exemptions (see "Exempt flows" in the `symmetry` module
    /// for what that approximates and checks). Default true.
    pub symmetry_exempt: bool,
    /// Completion times a chain must have repeated over (and, on average, flows each chain
    /// must still have to run). Default 5. Short rings are the hard case: the lanes of the
    /// 8-rank data-parallel rings of a GPT step on 64 GPUs (7 steps, 4 channels drifting
    /// against each other) can repeat a time three or four times and then change it by
    /// half. Against the reference of that step, before flows in progress were held at the
    /// switch (see the `periodic` module), a window of 3 gave a 6.0% p99 flow-completion
    /// error, 4 gave 0.45% and 5 gave 0.012%. With 5, chains of fewer than 10 flows (the
    /// lanes of an all-reduce ring of up to 5 ranks, of a reduce-scatter or all-gather ring
    /// of up to 10) are never extrapolated. A longer window only delays the start by a step
    /// per sample.
    pub period_window: usize,
    /// Largest relative spread `(max - min) / mean` of a chain's last `period_window`
    /// completion times. Default 0.01, the mean FCT error bound the extrapolation must keep.
    pub period_theta: f64,
    /// Largest relative spread `(max - min) / mean` of the gaps between a chain's last
    /// `period_window` releases (its period). Default 0.05. A moving period means the
    /// chain's phase against its neighbours is moving, and with it the contention its
    /// flows will meet, so the period is bounded too, but more loosely than the completion
    /// times: a ring whose hops are not all alike (the hops between two pods take a few
    /// microseconds more) sends a one-off shift of its period round the ring, one rank per
    /// step, which every chain would otherwise wait out. Under 1%, a 64-rank ring
    /// reduce-scatter across two pods simulated 35 of its 63 steps. See "Steady lanes" in
    /// the `periodic` module for the measurements.
    pub period_gap_theta: f64,
    /// Whether a chain that has its data path to itself within its collective (no other
    /// chain of the collective sends data over any of its links, as each hop of a
    /// one-channel ring) is steady on its completion times alone, its period not held to
    /// `period_gap_theta`. Default true. Its phase against its neighbours moves only their
    /// ACKs against its data; chains that share links (the channels of a multi-channel
    /// ring) keep the bound. On the GPT 350M step at 2,048 GPUs (pinned), whose
    /// data-parallel rings of 1 MB steps cross between two pods, the period bound kept
    /// its gradient reduce-scatters simulating 32 to 36 of each lane's 63 steps (4 to 6
    /// without it); see "Steady lanes" in the `periodic` module for the measurements.
    pub period_own_paths: bool,
    /// Period of the delivered-rate and queue samples. Default 2.5 us, half a base RTT of
    /// a three-tier fabric with 1 us cables. What a partition waits for after a change
    /// (the quiet window, a queue's course, the last sample before a completion or a
    /// release) is counted in samples, so it shrinks with the interval. Measured
    /// (docs/benchmarks.md, 2026-12-06): the 405B pipeline step on 128 GPUs (`orrery
    /// netsim`) took 14.5M events at 10 us (the default until the morning), 11.9M at 5 us
    /// (until the evening), 9.0M at 2.5 us and 8.2M at 2 us, with errors about the
    /// reference's own spread over seeds; the 8,192-GPU step 1.51G, 1.32G, 1.24G and
    /// 2.15G, at 2 us because fewer of its data-parallel reduce-scatters went periodic (40
    /// extrapolated against 49, each of the others simulating about 990 of its 4,032 flows
    /// instead of 252; why was not found; at 2.5 us all 49 go periodic). Measured again
    /// on 2026-12-07 (after `period_own_paths`): the 8,192-GPU step at 2 us (window 100)
    /// has all 49 periodic and takes 1.12G events against 1.16G; the 405B step on 128
    /// GPUs 1.4% to 9.3% fewer events over seeds 0 to 4, but at seed 0, the bench's, 109
    /// flows more than 5% off the reference instead of 25 (p99 35% against 2.4%), where
    /// the other seeds moved by a few flows either way: 2.5 us stays. Packet
    /// quantisation, 4% of a 100 Gb/s flow's sample at 2 us and 3.2% at 2.5 us, is kept
    /// out of the steadiness test by testing blocks of samples ([`AccelConfig::theta`]).
    /// Sampling costs a pass over the active partitions per interval.
    pub sample_interval: Picos,
    /// Samples a flow must be steady over. Default 80 (200 us at the default interval):
    /// four DCQCN CNP intervals (50 us) and 50 rate-decrease periods (4 us), so a flow under
    /// rate control has been cut and recovered within the window. The published default
    /// (2000) is for per-RTT-scale sampling of long runs; at 2.5 us it would require 5 ms
    /// of steadiness and nothing shorter than a few hundred MB per flow would ever jump.
    /// The fast-forward state holds this many samples per flow being sampled (32 bytes
    /// each; a finished flow's ring goes to the next) and per link (8 bytes).
    pub window: usize,
    /// Largest relative spread `(max - min) / mean` of a steady flow's samples. Default
    /// 0.05 (the published value). The spread is taken over blocks of consecutive samples
    /// that deliver `2 / theta` packets each on average (one sample at 200 Gb/s and
    /// 2.5 us, two at 100 Gb/s), three blocks at least, so the packet by which an even pace's
    /// counts differ is at most half of `theta`.
    pub theta: f64,
    /// Largest relative spread `(max - min) / max` of a steady flow's DCQCN sending rate
    /// over the window, and largest gap between a recovering flow's target and current
    /// rate. Default 0.01. The delivered rate of a flow at a shared bottleneck is flat
    /// while its DCQCN rate still drifts (CNPs cutting it ~1% at a time as the queue
    /// builds); a jump freezes that state, and the lag shows once the contention ends and
    /// the flow runs at its own rate again. 1% keeps that lag inside the 1% mean FCT bound.
    pub rate_theta: f64,
    /// Whether a partition may jump through a stretch in which DCQCN keeps cutting its
    /// flows' rates while something else holds their deliveries (a *cut jump*): each such
    /// flow's receiver sent CNPs in one unbroken run over the window (its queue stands deep
    /// in the marking range, typically held there by PFC), its rate has only fallen, and
    /// it still sends more than `theta` above what it delivers, so the cuts do not change
    /// what it delivers yet. The jump moves bytes at the delivered rates as any jump does,
    /// and drives each such flow's DCQCN state through the CNPs it would receive (at the
    /// run's cadence, about one per `cnp_interval`), stopping before its rate comes within
    /// `theta` of its delivered rate. Default true. On two 50 MB flows into one 400 Gb/s
    /// port the queue stands at PFC's threshold for about a millisecond while their rates
    /// fall by ~1% per CNP from 257 to 200 Gb/s; without these jumps every packet of that
    /// stretch is simulated. See "Cut jumps" in the `accel` module.
    pub cut_jumps: bool,
    /// Largest drift of a switch egress queue on a jumping partition's links over its ECN
    /// threshold (or anywhere, without DCQCN), as a fraction of its link's speed: the
    /// difference between the queue's mean over the second and the first half of the
    /// window, over the time between them. Default 0.01, as `rate_theta`: a queue drifting
    /// faster has senders DCQCN has not brought to its speed yet. A jump freezes queues;
    /// the other queue rules, which this value also turns off when infinite, are in
    /// `Engine::queues_steady` (`packet/accel.rs`): with DCQCN, a queue under the threshold
    /// that would reach it before the partition's flows end is not steady, nor one over it
    /// while none of the flows has been cut within the window. A two-flow chain at
    /// 400 Gb/s, its middle host's link carrying one flow's data at line rate and the
    /// other's ACKs (8% over the link's speed), jumped with that queue growing and missed
    /// its first mark: the first flow finished 33% early.
    pub queue_theta: f64,
    /// Simulated time left before the earliest projected completion when a jump stops, so
    /// the end of every flow (its last packets, the queue draining behind it, the
    /// completion of others it releases) is simulated packet by packet. Default 50 us
    /// (several RTTs plus a DCQCN CNP interval).
    pub tail_margin: Picos,
    /// Shortest jump worth taking; shorter ones are not taken. Default 20 us.
    pub min_jump: Picos,
    /// Samples a partition must have been *quiet* over to jump after that short a window
    /// instead of `window` (with `partitioning`; 0 turns quiet jumps off). A partition is
    /// quiet at a sample when no switch egress queue on its links holds enough bytes to be
    /// ECN-marked, no port of it is paused or pausing, and, with DCQCN, no flow has a rate
    /// cut pending ([`crate::packet::dcqcn::ReactionPoint::rate_held`]). Its flows are
    /// then limited by their senders' ports, DCQCN rates and the FIFOs serving them:
    /// nothing marks them, so their rates cannot drift, which is what the long window
    /// waits out; a flow recovering from an earlier cut changes its rate at its next
    /// increase, where the jump stops, and a queue growing towards its threshold or
    /// draining after a cut is carried through the jump (`packet/accel/carry.rs`).
    /// Default 3 (7.5 us at the default interval, a few round trips; a flow too slow to
    /// fill three blocks of the steadiness test in that time waits until it has); the
    /// delivered-rate spread is still tested over those samples. On the 405B pipeline
    /// step (128 GPUs), over seeds 0 to 2, the flows more than 5% off the reference of
    /// their seed numbered 83, 45 and 59 (2.5 us, 3 samples; 67 and 67 on seeds 3 and 4),
    /// 29, 46 and 59 (5 us, 3 samples), 52, 39 and 94 (2 us, 3 samples) and 29, 43 and 87
    /// (2 us, 5 samples), against 37 to 73 between the reference's own seeds
    /// (docs/benchmarks.md).
    /// At 10 us samples, windows of 3, 5 and 10 for every partition, quiet or not, tried
    /// on the bench's GPT 350M step on 64 GPUs, left its p99 flow error against the
    /// reference at 0.046% (as with 20) and its mean between 0.002% and 0.0035%; on
    /// congested traffic a short window would jump through DCQCN's drift, which is why
    /// only quiet partitions get one.
    pub quiet_window: usize,
    /// `tail_margin` for a jump of a quiet partition. Default 10 us. No CNP interval is
    /// needed, as nothing marks, and no round trip either: a jump keeps every packet in
    /// flight where it is, so the end of a flow (its last packets sent, the pipe behind
    /// them delivered) is simulated from the same state whatever the margin; the margin
    /// only keeps the projected last packet, which the measured rate places, out of the
    /// jump. Where a queue of the partition stands deeper than a frame, the time it takes
    /// to drain at its link's speed (from its threshold, if it is carried towards it) is
    /// added, as the flows' last packets wait behind it. On the 405B pipeline step (128
    /// GPUs) the flows more than 5% off the reference of their seed numbered 24, 45, 59, 64
    /// and 60 over seeds 0 to 4 at 10 us, 83, 45, 59, 67 and 67 at 20 us, with 4% to 11%
    /// fewer events; shorter margins moved more flows across races (on seeds 1 and 2, 51
    /// and 75 flows off at 5 us, 60 and 88 at 2.5 us; docs/benchmarks.md). 50 us
    /// (`tail_margin`) until the morning of 2026-12-06, 20 us until its evening.
    pub quiet_tail_margin: Picos,
}

impl AccelConfig {
    /// Every mechanism off: the packet-by-packet reference.
    pub fn off() -> AccelConfig {
        AccelConfig {
            fast_forward: false,
            partitioning: false,
            memoize: false,
            mirror: false,
            periodic: false,
            collective_memo: false,
            symmetry: false,
            symmetry_exempt: false,
            ..AccelConfig::default()
        }
    }
}

impl Default for AccelConfig {
    fn default() -> Self {
        AccelConfig {
            fast_forward: true,
            partitioning: true,
            memoize: true,
            mirror: true,
            periodic: true,
            collective_memo: true,
            symmetry: true,
            symmetry_exempt: true,
            period_window: 5,
            period_theta: 0.01,
            period_gap_theta: 0.05,
            period_own_paths: true,
            sample_interval: Picos(2_500_000),
            window: 80,
            theta: 0.05,
            rate_theta: 0.01,
            cut_jumps: true,
            queue_theta: 0.01,
            tail_margin: Picos::from_micros(50),
            min_jump: Picos::from_micros(20),
            quiet_window: 3,
            quiet_tail_margin: Picos::from_micros(10),
        }
    }
}

impl PacketConfig {
    /// The defaults with every acceleration off: the packet-by-packet reference that the
    /// accelerated default is checked against.
    pub fn reference() -> PacketConfig {
        PacketConfig {
            accel: AccelConfig::off(),
            ..PacketConfig::default()
        }
    }
}

impl Default for PacketConfig {
    fn default() -> Self {
        PacketConfig {
            mtu_payload: 1000,
            header_bytes: 62,
            framing_bytes: 20,
            ack_bytes: 66,
            cnp_bytes: 78,
            pfc_frame_bytes: 64,
            ack_every: 1,
            nack: true,
            rto: Picos::from_micros(4000),
            max_retries: 7,
            buffer_bytes: 32 * 1024 * 1024,
            pfc: true,
            pfc_alpha: 0.125,
            pfc_resume_offset: 3 * 1024,
            pfc_reserve: 4 * 1024,
            pfc_headroom: None,
            ecn: vec![
                EcnPoint {
                    gbps: 100.0,
                    kmin: 400_000,
                    kmax: 1_600_000,
                    pmax: 0.2,
                },
                EcnPoint {
                    gbps: 400.0,
                    kmin: 800_000,
                    kmax: 3_200_000,
                    pmax: 0.2,
                },
            ],
            dcqcn: true,
            dcqcn_params: DcqcnParams::default(),
            seed: 0,
            lazy_port_frees: true,
            accel: AccelConfig::default(),
        }
    }
}

/// One problem with one field of a [`PacketConfig`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ConfigProblem {
    /// The field's path (`dcqcn_params.g`, `ecn[1].kmax`).
    pub field: String,
    /// What is wrong with it.
    pub reason: String,
}

impl PacketConfig {
    /// Every problem with this configuration, each with its field path; empty when valid.
    ///
    /// The simulator never panics on a bad configuration: it clamps each bad value to the
    /// nearest sensible one (documented per check below). Callers that take configurations
    /// from users should call this first and report the problems.
    pub fn problems(&self) -> Vec<ConfigProblem> {
        let mut out = Vec::new();
        let mut bad = |field: &str, reason: &str| {
            out.push(ConfigProblem {
                field: field.to_string(),
                reason: reason.to_string(),
            })
        };
        if self.mtu_payload == 0 {
            bad("mtu_payload", "must be at least 1 (clamped to 1)");
        }
        if self.ack_every == 0 {
            bad("ack_every", "must be at least 1 (clamped to 1)");
        }
        if self.rto == Picos::ZERO {
            bad("rto", "must be positive (clamped to 1 ps)");
        }
        if !(self.pfc_alpha.is_finite() && self.pfc_alpha > 0.0) {
            bad("pfc_alpha", "must be positive and finite (replaced by 1/8)");
        }
        for (i, p) in self.ecn.iter().enumerate() {
            if !(p.gbps.is_finite() && p.gbps > 0.0) {
                bad(
                    &format!("ecn[{i}].gbps"),
                    "must be positive and finite (point ignored)",
                );
            }
            if p.kmax < p.kmin {
                bad(
                    &format!("ecn[{i}].kmax"),
                    "must be at least kmin (raised to kmin)",
                );
            }
            if !(p.pmax.is_finite() && (0.0..=1.0).contains(&p.pmax)) {
                bad(&format!("ecn[{i}].pmax"), "must be in [0, 1] (clamped)");
            }
        }
        let d = &self.dcqcn_params;
        for (name, v) in [
            ("dcqcn_params.rate_increase_timer", d.rate_increase_timer),
            (
                "dcqcn_params.alpha_update_interval",
                d.alpha_update_interval,
            ),
            (
                "dcqcn_params.rate_decrease_interval",
                d.rate_decrease_interval,
            ),
        ] {
            if v == Picos::ZERO {
                bad(name, "must be positive (clamped to 1 ps)");
            }
        }
        if !(d.g.is_finite() && d.g > 0.0 && d.g <= 1.0) {
            bad("dcqcn_params.g", "must be in (0, 1] (replaced by 1/256)");
        }
        for (name, v) in [
            ("dcqcn_params.additive_increase", d.additive_increase),
            ("dcqcn_params.hyper_increase", d.hyper_increase),
        ] {
            if !(v.0.is_finite() && v.0 >= 0.0) {
                bad(name, "must be non-negative and finite (replaced by 0)");
            }
        }
        if !(d.min_rate.0.is_finite() && d.min_rate.0 > 0.0) {
            bad(
                "dcqcn_params.min_rate",
                "must be positive and finite (replaced by 100 Mb/s)",
            );
        }
        if !(d.initial_alpha.is_finite() && (0.0..=1.0).contains(&d.initial_alpha)) {
            bad("dcqcn_params.initial_alpha", "must be in [0, 1] (clamped)");
        }
        let a = &self.accel;
        if a.sample_interval == Picos::ZERO {
            bad(
                "accel.sample_interval",
                "must be positive (clamped to 1 us)",
            );
        }
        if a.window < 2 {
            bad("accel.window", "must be at least 2 (clamped to 2)");
        }
        if !(a.theta.is_finite() && a.theta >= 0.0) {
            bad(
                "accel.theta",
                "must be non-negative and finite (replaced by 0.05)",
            );
        }
        if !(a.rate_theta.is_finite() && a.rate_theta >= 0.0) {
            bad(
                "accel.rate_theta",
                "must be non-negative and finite (replaced by 0.01)",
            );
        }
        if a.queue_theta.is_nan() || a.queue_theta < 0.0 {
            bad(
                "accel.queue_theta",
                "must be non-negative (replaced by 0.01)",
            );
        }
        if a.period_window == 0 {
            bad("accel.period_window", "must be at least 1 (clamped to 1)");
        }
        if !(a.period_theta.is_finite() && a.period_theta >= 0.0) {
            bad(
                "accel.period_theta",
                "must be non-negative and finite (replaced by 0.01)",
            );
        }
        if !(a.period_gap_theta.is_finite() && a.period_gap_theta >= 0.0) {
            bad(
                "accel.period_gap_theta",
                "must be non-negative and finite (replaced by 0.05)",
            );
        }
        out
    }

    /// The configuration with every bad value clamped as [`PacketConfig::problems`]
    /// describes, and the ECN table sorted by speed with bad points removed.
    pub fn sanitized(&self) -> PacketConfig {
        let mut c = self.clone();
        c.mtu_payload = c.mtu_payload.max(1);
        c.ack_every = c.ack_every.max(1);
        c.rto = c.rto.max(Picos(1));
        if !(c.pfc_alpha.is_finite() && c.pfc_alpha > 0.0) {
            c.pfc_alpha = 0.125;
        }
        c.ecn.retain(|p| p.gbps.is_finite() && p.gbps > 0.0);
        for p in &mut c.ecn {
            p.kmax = p.kmax.max(p.kmin);
            p.pmax = if p.pmax.is_finite() {
                p.pmax.clamp(0.0, 1.0)
            } else {
                1.0
            };
        }
        c.ecn.sort_by(|a, b| a.gbps.total_cmp(&b.gbps));
        let d = &mut c.dcqcn_params;
        d.rate_increase_timer = d.rate_increase_timer.max(Picos(1));
        d.alpha_update_interval = d.alpha_update_interval.max(Picos(1));
        d.rate_decrease_interval = d.rate_decrease_interval.max(Picos(1));
        if !(d.g.is_finite() && d.g > 0.0 && d.g <= 1.0) {
            d.g = 1.0 / 256.0;
        }
        for v in [&mut d.additive_increase, &mut d.hyper_increase] {
            if !(v.0.is_finite() && v.0 >= 0.0) {
                *v = Bandwidth(0.0);
            }
        }
        if !(d.min_rate.0.is_finite() && d.min_rate.0 > 0.0) {
            d.min_rate = Bandwidth::from_gbits_per_sec(0.1);
        }
        d.initial_alpha = if d.initial_alpha.is_finite() {
            d.initial_alpha.clamp(0.0, 1.0)
        } else {
            1.0
        };
        let a = &mut c.accel;
        if a.sample_interval == Picos::ZERO {
            a.sample_interval = Picos::from_micros(1);
        }
        a.window = a.window.max(2);
        if !(a.theta.is_finite() && a.theta >= 0.0) {
            a.theta = 0.05;
        }
        if !(a.rate_theta.is_finite() && a.rate_theta >= 0.0) {
            a.rate_theta = 0.01;
        }
        if a.queue_theta.is_nan() || a.queue_theta < 0.0 {
            a.queue_theta = 0.01;
        }
        a.period_window = a.period_window.max(1);
        if !(a.period_theta.is_finite() && a.period_theta >= 0.0) {
            a.period_theta = 0.01;
        }
        if !(a.period_gap_theta.is_finite() && a.period_gap_theta >= 0.0) {
            a.period_gap_theta = 0.05;
        }
        c
    }

    /// The ECN thresholds for an egress port of `bandwidth`.
    ///
    /// The table (sorted by speed) is read as a piecewise-linear function of the link
    /// speed: below the slowest point thresholds scale in proportion to the speed (a link
    /// at a quarter of 100 Gb/s marks at a quarter of the queue: 25 Gb/s -> 100/400 KB),
    /// between two points Kmin, Kmax and Pmax are interpolated linearly (200 Gb/s ->
    /// 533/2133 KB), and above the fastest point they scale in proportion again
    /// (800 Gb/s -> 1600/6400 KB). An empty table disables marking.
    pub fn ecn_for(&self, bandwidth: Bandwidth) -> EcnThresholds {
        let none = EcnThresholds {
            kmin: f64::INFINITY,
            kmax: f64::INFINITY,
            pmax: 0.0,
        };
        let speed = bandwidth.0 * 8.0 / 1e9;
        let pts: Vec<&EcnPoint> = self
            .ecn
            .iter()
            .filter(|p| p.gbps.is_finite() && p.gbps > 0.0)
            .collect();
        let (Some(first), Some(last)) = (pts.first(), pts.last()) else {
            return none;
        };
        let scaled = |p: &EcnPoint, s: f64| EcnThresholds {
            kmin: p.kmin as f64 * s,
            kmax: p.kmax as f64 * s,
            pmax: p.pmax,
        };
        if !(speed.is_finite() && speed > 0.0) {
            return none;
        }
        if speed <= first.gbps {
            return scaled(first, speed / first.gbps);
        }
        if speed >= last.gbps {
            return scaled(last, speed / last.gbps);
        }
        for w in pts.windows(2) {
            let (a, b) = (w[0], w[1]);
            if speed <= b.gbps {
                let t = if b.gbps > a.gbps {
                    (speed - a.gbps) / (b.gbps - a.gbps)
                } else {
                    1.0
                };
                let lerp = |x: f64, y: f64| x + (y - x) * t;
                return EcnThresholds {
                    kmin: lerp(a.kmin as f64, b.kmin as f64),
                    kmax: lerp(a.kmax as f64, b.kmax as f64),
                    pmax: lerp(a.pmax, b.pmax),
                };
            }
        }
        scaled(last, speed / last.gbps)
    }

    /// Line bytes of a full data packet (payload + headers + framing).
    pub fn data_wire_bytes(&self) -> u64 {
        u64::from(self.mtu_payload) + u64::from(self.header_bytes) + u64::from(self.framing_bytes)
    }

    /// The PFC headroom of an ingress port fed by a link of `bandwidth` and `delay`.
    pub fn headroom_for(&self, bandwidth: Bandwidth, delay: Picos) -> u64 {
        if let Some(h) = self.pfc_headroom {
            return h;
        }
        let bdp = bandwidth.0 * delay.as_secs_f64();
        let bdp = if bdp.is_finite() && bdp > 0.0 {
            bdp.ceil() as u64
        } else {
            0
        };
        2 * bdp
            + 3 * self.data_wire_bytes()
            + u64::from(self.pfc_frame_bytes)
            + u64::from(self.framing_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gbps(x: f64) -> Bandwidth {
        Bandwidth::from_gbits_per_sec(x)
    }

    #[test]
    fn ecn_table_points_and_scaling() {
        let c = PacketConfig::default();
        let at = |g: f64| c.ecn_for(gbps(g));
        let close = |a: f64, b: f64| (a - b).abs() < 1e-6 * b.abs().max(1.0);
        assert!(close(at(100.0).kmin, 400_000.0) && close(at(100.0).kmax, 1_600_000.0));
        assert!(close(at(400.0).kmin, 800_000.0) && close(at(400.0).kmax, 3_200_000.0));
        assert!(close(at(25.0).kmin, 100_000.0) && close(at(25.0).kmax, 400_000.0));
        assert!(close(at(200.0).kmin, 400_000.0 + 400_000.0 / 3.0));
        assert!(close(at(800.0).kmin, 1_600_000.0));
        assert!(close(at(250.0).pmax, 0.2));
        let empty = PacketConfig {
            ecn: Vec::new(),
            ..PacketConfig::default()
        };
        assert_eq!(empty.ecn_for(gbps(100.0)).probability(1e12), 0.0);
    }

    #[test]
    fn red_probability() {
        let t = EcnThresholds {
            kmin: 100.0,
            kmax: 300.0,
            pmax: 0.2,
        };
        assert_eq!(t.probability(100.0), 0.0);
        assert!((t.probability(200.0) - 0.1).abs() < 1e-12);
        assert!((t.probability(300.0) - 0.2).abs() < 1e-12);
        assert_eq!(t.probability(301.0), 1.0);
    }

    #[test]
    fn defaults_are_valid_and_bad_values_are_reported_and_clamped() {
        assert!(PacketConfig::default().problems().is_empty());
        let mut c = PacketConfig {
            mtu_payload: 0,
            ack_every: 0,
            pfc_alpha: f64::NAN,
            ..PacketConfig::default()
        };
        c.dcqcn_params.g = 2.0;
        c.ecn[0].kmax = 1;
        let fields: Vec<String> = c.problems().into_iter().map(|p| p.field).collect();
        assert_eq!(
            fields,
            [
                "mtu_payload",
                "ack_every",
                "pfc_alpha",
                "ecn[0].kmax",
                "dcqcn_params.g"
            ]
        );
        let s = c.sanitized();
        assert!(s.problems().is_empty());
        assert_eq!(s.mtu_payload, 1);
        let mut c = PacketConfig::default();
        c.accel.sample_interval = Picos::ZERO;
        c.accel.window = 1;
        c.accel.theta = f64::NAN;
        c.accel.queue_theta = f64::NAN;
        c.accel.period_window = 0;
        c.accel.period_theta = -1.0;
        c.accel.period_gap_theta = f64::INFINITY;
        let fields: Vec<String> = c.problems().into_iter().map(|p| p.field).collect();
        assert_eq!(
            fields,
            [
                "accel.sample_interval",
                "accel.window",
                "accel.theta",
                "accel.queue_theta",
                "accel.period_window",
                "accel.period_theta",
                "accel.period_gap_theta"
            ]
        );
        let s = c.sanitized();
        assert!(s.problems().is_empty());
        assert_eq!(s.accel.window, 2);
        assert_eq!(s.accel.period_window, 1);
        assert_eq!(s.accel.period_theta, 0.01);
        assert_eq!(s.accel.period_gap_theta, 0.05);
        assert_eq!(s.accel.queue_theta, 0.01);
        // An infinite queue drift is allowed: it turns the queue test off.
        c.accel.queue_theta = f64::INFINITY;
        assert!(!c.problems().iter().any(|p| p.field == "accel.queue_theta"));
    }

    #[test]
    fn toml_round_trip_and_partial_tables() {
        let c = PacketConfig::default();
        let text = toml::to_string(&c).unwrap();
        let back: PacketConfig = toml::from_str(&text).unwrap();
        assert_eq!(back, c);
        let partial: PacketConfig =
            toml::from_str("pfc = false\nbuffer_bytes = 1000\n[dcqcn_params]\ng = 0.5\n").unwrap();
        assert!(!partial.pfc);
        assert_eq!(partial.buffer_bytes, 1000);
        assert_eq!(partial.dcqcn_params.g, 0.5);
        assert_eq!(partial.dcqcn_params.min_rate, c.dcqcn_params.min_rate);
        assert_eq!(partial.mtu_payload, 1000);
        assert!(toml::from_str::<PacketConfig>("mtu = 4096").is_err());
        let accel: PacketConfig =
            toml::from_str("[accel]\nfast_forward = true\ntheta = 0.02\n").unwrap();
        assert!(accel.accel.fast_forward);
        assert_eq!(accel.accel.theta, 0.02);
        assert_eq!(accel.accel.window, AccelConfig::default().window);
    }

    #[test]
    fn default_headroom_covers_two_bdps_and_three_frames() {
        let c = PacketConfig::default();
        // 100 Gb/s, 1 us: BDP 12 500 B.
        let h = c.headroom_for(gbps(100.0), Picos::from_micros(1));
        assert_eq!(h, 25_000 + 3 * 1082 + 84);
    }
}
