//! # The packet-level network model: RoCE hosts, shared-buffer switches, PFC, ECN, DCQCN
//!
//! The flow-level model ([`crate::flow_model`]) assumes the fabric has settled into fair
//! sharing. This model makes no such assumption: it simulates every packet of every flow on
//! the real topology, with the mechanisms that decide how an RDMA fabric behaves under
//! load (queues filling, ECN marks, congestion notifications, rate control, pause frames,
//! and, when pause is off, drops and retransmissions). It is the faithful reference the
//! accelerated model (partitioning, fast-forwarding, memoization) is checked against.
//!
//! Entry point: [`PacketSimulator`] (with its [`PacketConfig`]), which implements
//! [`FlowSimulator`] under the name `"packet"`; [`PacketSimulator::run`] also returns
//! counters ([`PacketStats`]) and an optional time series ([`TraceRequest`] ->
//! [`Sample`]s of delivered bytes, sending rates and queue depths). Beside it,
//! [`FluidSimulator`] (`"fluid"`) runs the same fabric under the same configuration with
//! bytes as a fluid instead of packets: an approximation of this model, measured against
//! it (the `fluid` module).
//!
//! ## The model
//!
//! **Flows and queue pairs.** Each flow of a [`FlowSet`] is one RDMA reliable-connection
//! queue pair from its source endpoint to its destination endpoint, released when its
//! dependencies have finished plus its delay. Its bytes are cut into packets of
//! `mtu_payload` (1000 B) payload plus `header_bytes` (62 B, RoCEv2) of headers; each frame
//! also takes `framing_bytes` (20 B: preamble and inter-frame gap) of line time. Data
//! follows the flow's ECMP route, computed once per flow with the flow model's hash
//! ([`crate::flow_model::flow_hash`]) so both models put a flow on the same path; ACKs,
//! NACKs and CNPs follow the reverse route (hashed the other way round).
//!
//! **Senders.** A queue pair sends at its current rate: after a frame of `w` bytes it may
//! send again `w / rate` later (a rate limiter; the rate is the NIC's line rate without
//! DCQCN). The queue pairs sharing a NIC port are served round-robin among those allowed to
//! send; the port sends control frames first, and no data while it is paused by PFC. There
//! is no window: RoCE with DCQCN is rate-based. Loss recovery is go-back-N: a NACK, or
//! `rto` (4 ms) without an acknowledgement while packets are outstanding, sends the queue
//! pair back to its first unacknowledged packet; after `max_retries` (7) timeouts without
//! progress the queue pair gives up and the simulation reports its flow unfinished.
//!
//! **Receivers** (the endpoint's NIC consumes at any speed, never pauses the fabric)
//! accept the next expected packet and discard any other. They ACK cumulatively every
//! `ack_every` (1) in-order packets and always the last one; they NACK the first
//! out-of-order packet after a gap, and again when the sender has visibly gone back but the
//! head is still missing; they send a CNP for an ECN-marked packet of a flow at most once
//! per `cnp_interval` (50 us), the DCQCN notification point. A flow *finishes* when its
//! last packet is delivered in order at the destination.
//!
//! **Switches** are store-and-forward: a packet is handled when its last bit arrives. Each
//! directed link has one egress FIFO for data (one priority class) and a strict-priority
//! queue for control frames (ACK, NACK, CNP), which are never paused and not counted in the
//! buffer, as RoCE deployments put them in a separate, higher class. Every port transmits
//! at its link's bandwidth; a packet reaches the next node `serialisation + propagation`
//! after it starts (serialisation = round(line bytes / bandwidth) in integer picoseconds).
//!
//! **Shared buffer and PFC** (per switch `buffer_bytes`, 32 MiB; the ns-3 HPCC switch MMU's
//! scheme, one priority): every ingress port has a reserve (`pfc_reserve`, 4 KiB) and a
//! headroom (`pfc_headroom`, by default `2 * bandwidth * delay + 3 MTU frames + a pause
//! frame` of its link); the rest of the buffer is the shared pool. A data packet arriving
//! on an ingress port goes into its reserve if it fits, else into the shared pool if the
//! port's shared use stays within the *dynamic threshold* `pfc_alpha * (free shared pool)`
//! (alpha 1/8), else into the headroom; it is dropped only if the headroom is full too
//! (never, with the default headroom). The port sends a *pause* to its upstream as soon as
//! it uses headroom or its shared use exceeds the threshold, and a *resume* when its
//! headroom is empty and its shared use is zero or `pfc_resume_offset` (3 KiB) below the
//! threshold. Bytes leave the accounting when the packet starts its egress transmission
//! (headroom first). A pause or resume frame takes effect at the upstream sender one
//! pause-frame serialisation plus the link's propagation delay after it is sent. The paused
//! sender finishes the frame it is sending and then sends no data (control frames still
//! go). `SimReport::pfc_pauses[l]` counts the pause frames sent to link `l`'s sender.
//! Without PFC (`pfc = false`) a switch drops a data packet that does not fit in its whole
//! buffer (tail drop); the dropped packet is counted in `drops` and recovered by
//! go-back-N.
//!
//! **ECN** (RED at egress): when a data packet leaves an egress queue, it is marked with
//! probability 0 if the queue it leaves behind is at most Kmin, `Pmax * (q - Kmin) /
//! (Kmax - Kmin)` up to Kmax, and 1 above (the ns-3 HPCC switch marks at dequeue in the
//! same way). Kmin/Kmax/Pmax come from the `ecn` table by link speed: 100 Gb/s 400 KB /
//! 1600 KB / 0.2, 400 Gb/s 800 KB / 3200 KB / 0.2, linear between table points and
//! proportional to the speed below the slowest and above the fastest point (25 Gb/s: 100 /
//! 400 KB; 800 Gb/s: 1600 / 6400 KB) — see [`PacketConfig::ecn_for`]. The uniform draw
//! that decides a mark is keyed, not streamed ([`orrery_des::keyed_unit`] of the seed, the
//! flow, the packet's sequence number and the link): runs are reproducible, and what one
//! group of flows draws cannot depend on the packets of traffic it never meets. With one
//! stream in event order it did: on 32 two-GPU all-reduces across pods (ECMP collisions),
//! fast-forwarding three isolated pairs shifted every other pair's draws and moved their
//! FCTs by 4.1% on average (43% p99) against the run without it; with keyed draws the
//! same jumps cost 0.019% (0.59% p99). (At four times that size the jumps still cost 1.2%
//! on average, through timing: a reduce-scatter that jumped hands the all-gather after it
//! to DCQCN microseconds off, and colliding pairs split their cables differently; see
//! docs/benchmarks.md.)
//!
//! **DCQCN** (reaction point at the sender, [`dcqcn::ReactionPoint`]): the Mellanox
//! variant as the ns-3 simulators implement it. The first CNP sets alpha to 1 and the
//! target rate to the current rate. Alpha is updated every `alpha_update_interval` (1 us):
//! `alpha = (1 - g) alpha + g` if a CNP arrived in the interval, else `(1 - g) alpha`, with
//! `g = 1/256`. Every `rate_decrease_interval` (4 us) with a CNP since the last check, the
//! rate is cut `Rc = max(min_rate, Rc (1 - alpha / 2))` (target clamped to the current rate
//! if in an increase stage or `clamp_target_rate`), and the rate-increase timer restarts.
//! Every `rate_increase_timer` (900 us) without a cut: fast recovery `Rc = (Rc + Rt) / 2`
//! for `fast_recovery_stages` (1) events, then additive increase `Rt += 50 Mb/s`, then
//! hyper increase `Rt += 100 Mb/s`, each followed by `Rc = (Rc + Rt) / 2`, capped at line
//! rate. Minimum rate 100 Mb/s. Queue pairs start at line rate. The byte counter of the
//! original DCQCN is not modelled (most deployments and the ns-3 `mlx` model increase on
//! the timer only).
//!
//! ## Defaults
//!
//! | field | default | source |
//! |---|---|---|
//! | `mtu_payload` | 1000 B | ns-3 RDMA simulators' packet payload |
//! | `header_bytes` | 62 B | RoCEv2: Eth 14 + IPv4 20 + UDP 8 + BTH 12 + ICRC 4 + FCS 4 |
//! | `framing_bytes` | 20 B | Ethernet preamble + SFD 8 + inter-frame gap 12 |
//! | `ack_bytes` | 66 B | RoCEv2 headers + AETH 4 |
//! | `cnp_bytes` | 78 B | RoCEv2 headers + 16 reserved |
//! | `pfc_frame_bytes` | 64 B | minimum Ethernet frame (802.1Qbb) |
//! | `ack_every` | 1 | per-packet ACKs (ns-3 `L2_ACK_INTERVAL 1`) |
//! | `nack` | true | RoCE go-back-N sequence-error NAK |
//! | `rto` | 4 ms | above one full 32 MiB buffer's drain time at 100 Gb/s (2.7 ms) |
//! | `max_retries` | 7 | InfiniBand `retry_cnt` maximum |
//! | `buffer_bytes` | 32 MiB | the issue; ns-3 HPCC `BUFFER_SIZE 32` |
//! | `pfc` | true | lossless RoCE |
//! | `pfc_alpha` | 1/8 | ns-3 HPCC MMU `pfc_a_shift = 3` |
//! | `pfc_resume_offset` | 3 KiB | ns-3 HPCC MMU `resume_offset` |
//! | `pfc_reserve` | 4 KiB | ns-3 HPCC MMU `reserve` |
//! | `pfc_headroom` | 2 BDP + 3 MTU frames + pause frame | bytes in flight while a pause travels |
//! | `ecn` | 100G: 400/1600 KB, 0.2; 400G: 800/3200 KB, 0.2 | the issue; ns-3 `KMIN_MAP` etc. |
//! | `dcqcn` | true | |
//! | `dcqcn_params.rate_increase_timer` | 900 us | the issue; ns-3 `RP_TIMER` |
//! | `dcqcn_params.alpha_update_interval` | 1 us | the issue; `ALPHA_RESUME_INTERVAL` |
//! | `dcqcn_params.rate_decrease_interval` | 4 us | the issue; `RATE_DECREASE_INTERVAL` |
//! | `dcqcn_params.g` | 1/256 | the issue; `EWMA_GAIN` |
//! | `dcqcn_params.additive_increase` | 50 Mb/s | the issue; `RATE_AI` |
//! | `dcqcn_params.hyper_increase` | 100 Mb/s | the issue; `RATE_HAI` |
//! | `dcqcn_params.min_rate` | 100 Mb/s | the issue; `MIN_RATE` |
//! | `dcqcn_params.fast_recovery_stages` | 1 | the issue; `FAST_RECOVERY_TIMES` |
//! | `dcqcn_params.clamp_target_rate` | false | ns-3 `CLAMP_TARGET_RATE 0` |
//! | `dcqcn_params.initial_alpha` | 1.0 | ns-3 `mlx` |
//! | `dcqcn_params.cnp_interval` | 50 us | DCQCN paper's N; ConnectX default |
//! | `seed` | 0 | |
//!
//! ## Reading the report
//!
//! `bytes_sent` counts every payload byte a sender put on its NIC, retransmissions
//! included, and `link_bytes` every payload byte each link carried, including packets a
//! switch later dropped; `bytes_delivered` counts in-order payload at receivers, so with PFC
//! `bytes_sent == bytes_delivered` exactly when nothing was retransmitted. `events` counts
//! every event handled (trace samples excepted), lazy timer firings that turn out to be
//! no-ops included.
//!
//! Consequences of the defaults worth knowing:
//! - Per-packet ACKs (66 B + framing per 1000 B) take about 8% of a link that also carries
//!   data the other way: a ring, where every NIC sends and receives, reaches ~0.86 of line
//!   rate in goodput (1000/1082 for headers, then ACKs). Set `ack_every` (and
//!   `mtu_payload = 4096`) for a closer model of coalescing ConnectX NICs.
//! - With CNPs at most every 50 us and alpha updated every 1 us with g = 1/256, alpha decays
//!   by ~18% between two CNPs of a flow and settles near 0.02, so each CNP cuts the rate by
//!   only ~1%: at a congested 100 Gb/s port the queue grows to the PFC equilibrium
//!   (`k / (8 + k)` of the shared pool for `k` busy ingress ports: ~11 MB for four with
//!   32 MiB) before DCQCN brings the rates down, and flows converge to fair shares over
//!   milliseconds.
//! - `buffer_bytes` must exceed the headroom and reserve of all the switch's ingress ports
//!   (about 32 KB per 100 Gb/s port with 1 us links); otherwise the shared pool is empty,
//!   every port pauses at once, and a switch can hold more than `buffer_bytes`.
//!
//! ## Determinism and cost
//!
//! Events are ordered by (integer picoseconds, scheduling sequence) in an
//! [`orrery_des::CalendarQueue`] (1 ns buckets over a 4 us window, a heap beyond it: the
//! same order as [`orrery_des::HeapQueue`], which it replaced: nearly every packet event lands
//! nanoseconds ahead, so the calendar's O(1) filing beats the heap's O(log n), and the
//! reference run of a 64 MiB ring all-reduce on 32 GPUs gives byte-identical flows in 5.04 s
//! of CPU instead of 6.84 s, medians of three); floats (rates, alpha, marking probabilities) never order
//! events, they only produce integer times by rounding. Queue pairs that join one NIC port
//! at the same picosecond are served in the order of keys drawn from the shape of their
//! collective as seen from their source (`host::tie_keys`), not of flow numbers, so a run
//! that repeats itself host by host does so to the picosecond, and renumbering the flows
//! no longer decides which of them goes first (ECN marking draws are keyed by flow
//! number, and ties between other events of one picosecond still go in the order they
//! were filed). The only randomness is ECN marking,
//! from `seed`. Events are a small `Copy` enum of arena indices; packets live in a reused
//! arena and per-port `VecDeque`s, so steady-state simulation allocates nothing per event.
//! DCQCN's periodic clocks are evaluated lazily (alpha decay in closed form, a decrease tick
//! only when a CNP is pending, a timer that stops at line rate), and the retransmission
//! timer is pushed back lazily, so idle mechanisms cost no events. A packet costs two
//! events per hop (end of serialisation, arrival) plus its ACK's two per hop.
//!
//! ## Acceleration
//!
//! Every mechanism is on by default; [`PacketConfig::reference`] turns them off
//! (`orrery netsim --reference`, or `--no-fast-forward`, `--no-partitioning`,
//! `--no-memo`, `--no-mirror`, `--no-periodic`, `--no-collective-memo`, `--no-symmetry`
//! one by one). `accel.fast_forward` turns on *steady-state fast-forwarding*: every
//! `accel.sample_interval` (2.5 us) the engine samples each active flow's delivered bytes
//! and DCQCN rate, and when every active flow has been steady for `accel.window` (80)
//! samples since the last release or completion (delivered spread under `theta` = 5%,
//! over blocks of samples long enough that packet quantisation stays under half of it,
//! sending-rate spread and recovery gap under `rate_theta` = 1%), and the switch queues
//! on their links are steady (none growing towards its ECN threshold or drifting over it
//! by more than `queue_theta` = 1% of its link; see the `accel` module), the whole network jumps
//! to the next release or `tail_margin` (50 us) before the earliest projected completion,
//! moving each flow's packets forward at its rate (the slope of its deliveries over the
//! second half of the window) with every queue, pause and DCQCN
//! state frozen. The jump is a time offset: local time and pending events stay put, the
//! report shows global time. `PacketStats` counts the jumps, the jumped time and the
//! skipped packets, bytes and (estimated) events; per-packet counters other than ACKs
//! (ECN marks, CNPs, PFC frames) are not extrapolated over jumps, and a trace has a gap
//! where the run jumped. With acceleration off the simulation is unchanged; with it on but
//! no jump taken the report is identical too. Without `accel.partitioning` the whole
//! network is one partition, so one unsteady flow anywhere blocks every jump; with it each
//! connected component of active flows and their links jumps on its own (its pending
//! events postponed, its queues frozen), stopping at any release that touches it. A
//! partition in which nothing queues at a switch and no flow has a rate cut pending
//! (quiet, `accel.quiet_window`) jumps after 3 samples instead of 80 and stops 10 us
//! before a completion (or at a recovering flow's next rate increase) instead of 50: no
//! ECN mark can reach its flows, so there is no rate drift to wait out.
//! `accel.memoize` looks up isolated episodes (a group of flows released together onto
//! idle links, with the flows that join it) in a [`MemoCache`] instead of simulating them
//! again; see the `memo` module. `accel.periodic` finishes the flows of a collective whose
//! chains (a ring rank's flows to its successor, step after step) all repeat the same
//! completion time after that time, without packets; see the `periodic` module.
//! `accel.collective_memo` keeps the outcome of a collective with chains that ran alone on
//! its links and went periodic, and finishes a later collective of the same shape, started
//! on idle links with its outside releases due as recorded, at its times; see "Repeated
//! collectives" in the `periodic` module.
//! `accel.symmetry` simulates one copy of traffic that repeats itself host by host (a
//! ring over alike hosts) and gives the other copies its times; see the `symmetry` module,
//! which runs before the engine is built. The
//! designs, bounds and defaults are in the `accel`, `memo`, `periodic` and `symmetry` modules and
//! [`AccelConfig`]; `tests/accel.rs` is the equivalence harness.
//!
//! ## What is not modelled
//!
//! - Cut-through switching (every hop is store-and-forward), switch processing latency
//!   (fold it into link delay), multiple priority classes for data, PFC pause quanta and
//!   their expiry (a pause holds until the explicit resume), PFC from receiving hosts
//!   (hosts consume at any speed), PFC deadlock detection (routes are shortest paths on
//!   trees, where PFC cannot deadlock; a deadlock would end in timeouts and an
//!   `Unfinished` error).
//! - Egress admission limits and lossy-mode dynamic thresholds: without PFC the only limit
//!   is the whole buffer (tail drop).
//! - Control frames are never dropped or paused and do not occupy the shared buffer.
//! - HPCC, TIMELY and windowed congestion control; DCQCN's byte counter; NIC processing
//!   delays, PCIe and memory limits; per-packet ECMP or adaptive routing; link failures.
//! - ECN marking at hosts; CNP-on-ACK piggybacking (CNPs are separate frames).
//! - Clock drift between NICs: senders at equal rates stay in perfect lockstep. Without PFC
//!   this can phase-lock a full tail-drop buffer (the same sender wins every freed slot,
//!   the others lose every packet and recover only by timeout, one round of `rto` each);
//!   real fabrics break such ties by drift and jitter, so lossy incast results with many
//!   synchronised senders are pessimistic.

mod accel;
mod config;
pub mod dcqcn;
mod engine;
mod fluid;
mod host;
mod image;
mod memo;
mod partition;
mod periodic;
mod switch;
mod symmetry;

pub use config::{AccelConfig, ConfigProblem, DcqcnParams, EcnPoint, EcnThresholds, PacketConfig};
pub use fluid::{CalmSkipStats, FluidRun, FluidSimulator};
pub use memo::{MemoCache, MemoFileError};
pub use symmetry::SymmetryShift;

use crate::flows::FlowSet;
use crate::sim::{FlowSimulator, SimError, SimProgress, SimReport};
use crate::topology::NetGraph;
use orrery_units::{LinkId, Picos};
use serde::Serialize;
use std::sync::{Arc, Mutex};

/// The packet-level simulator.
///
/// With `accel.memoize` it keeps one [`MemoCache`] for all its runs (clones share it), so a
/// simulator reused for every collective of a prediction learns from each. Two simulators
/// are equal when their configurations are: the cache changes how fast a run is, and the
/// result only within the memo's tolerance.
#[derive(Debug, Clone, Default)]
pub struct PacketSimulator {
    pub config: PacketConfig,
    memo: Arc<Mutex<MemoCache>>,
}

impl PartialEq for PacketSimulator {
    fn eq(&self, other: &Self) -> bool {
        self.config == other.config
    }
}

/// What to record over time during a run (nothing by default).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TraceRequest {
    /// Sampling period; zero records nothing.
    pub interval: Picos,
    /// Links whose egress queue depth (bytes of data waiting at the sender) is sampled.
    pub ports: Vec<LinkId>,
    /// Whether each sample also records every flow's delivered bytes and rate. That costs
    /// 16 bytes per flow per sample: a queue trace of a 3,840-flow pipeline step every
    /// 2 us (1.6M samples) would need about 100 GB, so a trace of queues alone leaves
    /// it off and its samples' per-flow vectors stay empty.
    pub flows: bool,
}

/// One trace sample.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Sample {
    pub time: Picos,
    /// Payload bytes delivered in order so far, per flow (empty unless
    /// [`TraceRequest::flows`]).
    pub delivered: Vec<u64>,
    /// Current sending rate (bytes/s) per flow: the DCQCN rate, the line rate without
    /// DCQCN, zero before release and after completion (empty unless
    /// [`TraceRequest::flows`]).
    pub rate: Vec<f64>,
    /// Egress queue bytes of each requested port.
    pub queue: Vec<u64>,
}

/// Counters beyond the [`SimReport`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct PacketStats {
    /// Data packets marked with ECN at switches.
    pub ecn_marks: u64,
    /// CNPs sent by receivers.
    pub cnps: u64,
    /// ACKs sent by receivers.
    pub acks: u64,
    /// NACKs sent by receivers.
    pub nacks: u64,
    /// NACKs that sent a queue pair back.
    pub go_backs: u64,
    /// Retransmission timeouts.
    pub timeouts: u64,
    /// Payload bytes sent again (after a NACK or timeout).
    pub retransmitted_bytes: u64,
    /// Highest data occupancy of any switch buffer, bytes.
    pub peak_switch_bytes: u64,
    /// Events scheduled in the past (a simulator bug if non-zero).
    pub clamped_schedules: u64,
    /// Fast-forward jumps taken (zero unless `accel.fast_forward`).
    pub fast_forwards: u64,
    /// Of those, the partitioned jumps that held a recovering DCQCN flow, which stop at or
    /// before its next rate increase (see the `accel` module). Most end sooner, at a
    /// completion's margin or a release: on the 405B pipeline step at 128 GPUs, a scratch
    /// build that let jumps go through the increase took 264 jumps, 239 of them holding a
    /// recovering flow, and 10 of those reached its increase.
    pub recovering_jumps: u64,
    /// Of those, the jumps of quiet partitions, taken after `accel.quiet_window` samples
    /// instead of the whole window (see [`AccelConfig::quiet_window`]).
    pub quiet_jumps: u64,
    /// Of those, the jumps that drove a flow's DCQCN state through the cuts it would take
    /// at its receiver's cadence of CNPs (see [`AccelConfig::cut_jumps`]).
    pub cut_jumps: u64,
    /// Packets quiet jumps appended to switch queues growing towards their ECN thresholds,
    /// which they carry instead of freezing (the `carry` module of `packet/accel`).
    pub carried_packets: u64,
    /// Packets quiet jumps took out of draining switch queues: what their flows delivered
    /// beyond what they sent during the jump (the same module).
    pub drained_packets: u64,
    /// Simulated time covered by jumps instead of packet by packet (with partitioning,
    /// summed over partitions, so it can exceed the run's length).
    pub jumped_time: Picos,
    /// Data packets (and their payload bytes) moved by jumps instead of simulated. They
    /// are in `bytes_sent`, `bytes_delivered`, `link_bytes` and `acks`; ECN marks, CNPs
    /// and PFC frames that would have happened during a jump are not extrapolated.
    pub skipped_packets: u64,
    pub skipped_bytes: u64,
    /// Estimate of the events jumps saved: skipped packets times the events per data
    /// packet of the simulated part of the run. `events` counts processed events only.
    pub skipped_events: u64,
    /// Isolated episodes looked up in the memo cache (zero unless `accel.memoize`), found
    /// there, recorded into it, and hits aborted because another flow touched their links.
    pub memo_lookups: u64,
    pub memo_hits: u64,
    pub memo_recorded: u64,
    pub memo_aborts: u64,
    /// Hits not taken because the group's own dependents would have intruded, and
    /// simulated episodes not stored because another flow intruded.
    pub memo_declined: u64,
    pub memo_spoiled: u64,
    /// Groups that mirrored an isomorphic group started at the same instant instead of
    /// being simulated (`accel.mirror`), and mirrors that had to be simulated after all
    /// because the two stopped being alike (an intrusion on either, or a join one of them
    /// did not have); a broken mirror takes over its leader's exact state.
    pub memo_mirrored: u64,
    pub memo_mirror_breaks: u64,
    /// Data packets memoized episodes did not simulate (their bytes are in the report), and
    /// the events that saves (estimated as for fast-forwarding).
    pub memo_skipped_packets: u64,
    pub memo_skipped_events: u64,
    /// Events simulated again to roll aborted hits back (each aborted episode is replayed
    /// from its start to the intrusion); they are included in the run's `events`.
    pub memo_replayed_events: u64,
    /// Collectives that went periodic (`accel.periodic`), flows they finished virtually
    /// instead of simulating, and extrapolations ended by an intruding flow.
    pub periodic_starts: u64,
    pub periodic_flows: u64,
    pub periodic_aborts: u64,
    /// Virtual flows in progress that an intruder met: simulated from there on, and so not
    /// counted in `periodic_flows` (the packets they skipped are counted below).
    pub periodic_met: u64,
    /// Data packets virtual flows did not simulate (their bytes are in the report), and the
    /// events that saves (estimated as for fast-forwarding).
    pub periodic_skipped_packets: u64,
    pub periodic_skipped_events: u64,
    /// Collective memo (`accel.collective_memo`): collectives whose outcome was kept,
    /// collectives that repeated a kept outcome from their first release, repeats ended
    /// before their last flow (a release off its recorded offset, or other traffic on
    /// their links), flows finished from a kept outcome (flows met by an intruder are not
    /// counted), and the data packets and events those flows did not simulate (estimated
    /// as for fast-forwarding).
    pub collective_memo_records: u64,
    pub collective_memo_repeats: u64,
    pub collective_memo_aborts: u64,
    pub collective_memo_flows: u64,
    /// Flows finished from a kept outcome that an intruder met (simulated from there on,
    /// and so not counted in `collective_memo_flows`; see `periodic_met`).
    pub collective_memo_met: u64,
    pub collective_memo_skipped_packets: u64,
    pub collective_memo_skipped_events: u64,
    /// Copies of each simulated flow when the run was a symmetry quotient
    /// (`accel.symmetry`; 0 when it was not), the flows the quotient simulated, and the
    /// events of the copies it did not (estimated: `copies - 1` times the quotient's
    /// processed and skipped events). See the `symmetry` module.
    pub symmetry_order: u64,
    pub symmetry_flows: u64,
    pub symmetry_skipped_events: u64,
    /// Flows of at most one packet left out of the symmetry check and simulated each on
    /// its own (`accel.symmetry_exempt`), and the flows waiting for them whose times were
    /// carried through their dependencies, each counted at the level that exempted it.
    pub symmetry_exempt_flows: u64,
    pub symmetry_late_flows: u64,
    /// Events of quotient runs set aside because their late flows came out of step with
    /// their copies (the run was then simulated again with a stricter symmetry); they are
    /// included in the run's `events`.
    pub symmetry_retried_events: u64,
    /// Why partitions did not jump (with `accel.partitioning`; see [`FastForwardHeld`]).
    pub ff_held: FastForwardHeld,
}

/// What held partitioned fast-forwarding back, in *flow-samples*: at each fast-forward
/// sample, every member flow (active, or finished with packets still in flight) of a
/// partition that is not frozen in a jump counts once, under [`HeldBy::Jumped`] if its
/// partition jumped then and otherwise under the first test it failed. A flow-sample is
/// `accel.sample_interval` of that flow's simulated time, so the shares say where the
/// simulated flow-time went and which rule kept it from being skipped. With a symmetry
/// quotient these are the quotient's flows'. Zero without partitioning. Serialised as one
/// count per [`HeldBy::key`], in the order of the tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FastForwardHeld {
    counts: [u64; HeldBy::ALL.len()],
}

/// Where a partition's sample went: its jump, or the test that held it back, in the order
/// the tests are made (the `accel` module's essay says what each is for).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeldBy {
    /// The partition jumped at this sample.
    Jumped,
    /// A member has finished and its last packets are still in flight.
    Draining,
    /// Not quiet (a queue deep enough to be marked, a PFC pause, or a DCQCN cut pending),
    /// and the long window has not passed since the partition last changed.
    Busy,
    /// Quiet, but not yet for `accel.quiet_window` samples since the partition last
    /// changed (a flow started or ended on its links).
    Settling,
    /// A flow is retransmitting, or has sent its last packet.
    FlowEnding,
    /// A flow has too few samples at its rate to measure that rate to `accel.theta`.
    FlowRateUnmeasured,
    /// A flow's delivered bytes per block of samples spread by more than `accel.theta`.
    FlowUnsteady,
    /// A flow's DCQCN sending rate moved by more than `accel.rate_theta`.
    DcqcnRateMoving,
    /// A switch queue whose course is not yet known well enough to freeze it or carry it
    /// through a jump (too few samples, not on a line, its drift not measured to a tenth,
    /// or level within what its samples can tell but close enough to its threshold).
    QueueCourseUnmeasured,
    /// A carried queue a guard or less from its ECN threshold (or, draining, from empty),
    /// or a carry the path or the switch buffer does not allow.
    QueueAtItsLimit,
    /// A queue drifting by more than `accel.queue_theta`.
    QueueDrifting,
    /// A flow's completion is closer than the tail margin plus `accel.min_jump`.
    CompletionNear,
    /// Another bound closer than `accel.min_jump`: a release that will touch the
    /// partition, a recovering flow's next rate increase, a memoized episode's end.
    OtherBoundNear,
}

impl HeldBy {
    /// Every reason, in the order of the tests.
    pub const ALL: [HeldBy; 13] = [
        HeldBy::Jumped,
        HeldBy::Draining,
        HeldBy::Busy,
        HeldBy::Settling,
        HeldBy::FlowEnding,
        HeldBy::FlowRateUnmeasured,
        HeldBy::FlowUnsteady,
        HeldBy::DcqcnRateMoving,
        HeldBy::QueueCourseUnmeasured,
        HeldBy::QueueAtItsLimit,
        HeldBy::QueueDrifting,
        HeldBy::CompletionNear,
        HeldBy::OtherBoundNear,
    ];

    /// Its name in a report.
    pub fn name(self) -> &'static str {
        match self {
            HeldBy::Jumped => "jumped",
            HeldBy::Draining => "draining",
            HeldBy::Busy => "busy",
            HeldBy::Settling => "settling",
            HeldBy::FlowEnding => "flow ending",
            HeldBy::FlowRateUnmeasured => "flow rate unmeasured",
            HeldBy::FlowUnsteady => "flow unsteady",
            HeldBy::DcqcnRateMoving => "DCQCN rate moving",
            HeldBy::QueueCourseUnmeasured => "queue course unmeasured",
            HeldBy::QueueAtItsLimit => "queue at its limit",
            HeldBy::QueueDrifting => "queue drifting",
            HeldBy::CompletionNear => "completion near",
            HeldBy::OtherBoundNear => "other bound near",
        }
    }

    /// Its key in JSON: its name in snake case (`dcqcn_rate_moving`).
    pub fn key(self) -> String {
        self.name().to_lowercase().replace(' ', "_")
    }
}

impl FastForwardHeld {
    /// The flow-samples counted under `by`.
    pub fn get(&self, by: HeldBy) -> u64 {
        self.counts[by as usize]
    }

    /// Counts `flows` flow-samples under `by`.
    pub fn add(&mut self, by: HeldBy, flows: u64) {
        self.counts[by as usize] += flows;
    }

    /// Every flow-sample counted, jumped or not.
    pub fn total(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// Every reason with its count, in the order of the tests.
    pub fn counts(&self) -> impl Iterator<Item = (HeldBy, u64)> + '_ {
        HeldBy::ALL.iter().map(|&by| (by, self.get(by)))
    }
}

impl Serialize for FastForwardHeld {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = serializer.serialize_map(Some(HeldBy::ALL.len()))?;
        for (by, n) in self.counts() {
            map.serialize_entry(&by.key(), &n)?;
        }
        map.end()
    }
}

impl PacketStats {
    /// Memo hits per lookup (zero without lookups).
    pub fn memo_hit_rate(&self) -> f64 {
        crate::sim::AccelCounts {
            skipped_events: 0,
            memo_lookups: self.memo_lookups,
            memo_hits: self.memo_hits,
        }
        .memo_hit_rate()
    }

    /// The counters of flows finished without packets, a repeated collective's
    /// (`repeated`) or a periodic lane's: flows, skipped packets, skipped events, and
    /// flows an intruder met.
    pub(super) fn virtual_counters(&mut self, repeated: bool) -> [&mut u64; 4] {
        if repeated {
            [
                &mut self.collective_memo_flows,
                &mut self.collective_memo_skipped_packets,
                &mut self.collective_memo_skipped_events,
                &mut self.collective_memo_met,
            ]
        } else {
            [
                &mut self.periodic_flows,
                &mut self.periodic_skipped_packets,
                &mut self.periodic_skipped_events,
                &mut self.periodic_met,
            ]
        }
    }

    /// Events skipped by every mechanism (estimated).
    pub fn total_skipped_events(&self) -> u64 {
        self.skipped_events
            + self.memo_skipped_events
            + self.periodic_skipped_events
            + self.collective_memo_skipped_events
            + self.symmetry_skipped_events
    }
}

/// Everything a run produces.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PacketRun {
    pub report: SimReport,
    pub stats: PacketStats,
    pub samples: Vec<Sample>,
    /// Per flow (by id), the events of `report.events` that were the flow's own: arrivals of
    /// its packets (data, ACK, NACK, CNP) and its timers. A flow whose packets were never
    /// simulated (a memo hit, a mirror that held, a virtual flow of a periodic collective)
    /// has none. Releases (a memo hit's flow is released too), port events (transmission
    /// ends, PFC frames, wake-ups), which belong to links, and the replays of rolled-back
    /// memo hits are not attributed.
    pub flow_events: Vec<u64>,
    /// The rotations symmetry reduction found, outermost first (their copies multiply to
    /// [`PacketStats::symmetry_order`]); empty when it found none.
    pub symmetry: Vec<SymmetryShift>,
}

impl PacketSimulator {
    pub fn new(config: PacketConfig) -> PacketSimulator {
        PacketSimulator {
            config,
            memo: Arc::default(),
        }
    }

    /// A simulator whose memoization starts from `cache` (e.g. one loaded from a file).
    pub fn with_cache(config: PacketConfig, cache: MemoCache) -> PacketSimulator {
        PacketSimulator {
            config,
            memo: Arc::new(Mutex::new(cache)),
        }
    }

    /// A copy of the memo cache as it is now (to save it).
    pub fn cache(&self) -> MemoCache {
        match self.memo.lock() {
            Ok(c) => c.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Simulates `flows` on `graph`, recording what `trace` asks for. Bad configuration
    /// values are clamped (see [`PacketConfig::problems`]); trace samples are not counted
    /// as events and do not change the report.
    pub fn run(
        &self,
        graph: &NetGraph,
        flows: &FlowSet,
        trace: &TraceRequest,
    ) -> Result<PacketRun, SimError> {
        self.run_with_progress(graph, flows, trace, &mut |_| {})
    }

    /// [`PacketSimulator::run`] reporting progress every few thousand events.
    pub fn run_with_progress(
        &self,
        graph: &NetGraph,
        flows: &FlowSet,
        trace: &TraceRequest,
        progress: &mut dyn FnMut(SimProgress),
    ) -> Result<PacketRun, SimError> {
        let cfg = self.config.sanitized();
        // A panic in another run cannot leave the cache half-written (entries are inserted
        // whole), so a poisoned lock is still a consistent cache.
        let mut cache = match self.memo.lock() {
            Ok(c) => c,
            Err(poisoned) => poisoned.into_inner(),
        };
        flows.check()?;
        let routes = engine::Routes::compute(graph, flows)?;
        let ties = host::tie_keys(graph, flows);
        let exempt_bytes = if cfg.accel.symmetry_exempt {
            u64::from(cfg.mtu_payload)
        } else {
            0
        };
        symmetry::simulate_reduced(
            graph,
            flows,
            routes,
            &ties,
            cfg.accel.symmetry,
            exempt_bytes,
            progress,
            |flows, routes, copies, ties, levels, progress| {
                let q_trace = levels.iter().fold(trace.clone(), |t, q| q.trace(&t));
                engine::Engine::with_routes(
                    &cfg,
                    graph,
                    flows,
                    routes,
                    copies,
                    ties,
                    &q_trace,
                    Some(&mut cache),
                )?
                .run(progress)
            },
        )
    }
}

impl FlowSimulator for PacketSimulator {
    fn name(&self) -> &'static str {
        "packet"
    }

    fn simulate(&self, graph: &NetGraph, flows: &FlowSet) -> Result<SimReport, SimError> {
        Ok(self.run(graph, flows, &TraceRequest::default())?.report)
    }

    fn simulate_with_progress(
        &self,
        graph: &NetGraph,
        flows: &FlowSet,
        progress: &mut dyn FnMut(SimProgress),
    ) -> Result<SimReport, SimError> {
        Ok(self
            .run_with_progress(graph, flows, &TraceRequest::default(), progress)?
            .report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_back_counts_are_indexed_and_serialised_in_the_order_of_the_tests() {
        // A reason's count sits at its place in `ALL`, so each counts under its own key.
        for (i, by) in HeldBy::ALL.into_iter().enumerate() {
            assert_eq!(by as usize, i, "{by:?}");
        }
        let mut held = FastForwardHeld::default();
        held.add(HeldBy::DcqcnRateMoving, 3);
        held.add(HeldBy::Jumped, 2);
        held.add(HeldBy::DcqcnRateMoving, 1);
        assert_eq!(held.get(HeldBy::DcqcnRateMoving), 4);
        assert_eq!(held.total(), 6);
        let json = serde_json::to_string(&held).unwrap();
        assert!(
            json.starts_with("{\"jumped\":2,\"draining\":0,\"busy\":0,"),
            "{json}"
        );
        assert!(json.contains("\"dcqcn_rate_moving\":4,"), "{json}");
        assert!(json.ends_with("\"other_bound_near\":0}"), "{json}");
    }
}
