//! Symmetry reduction (issue 4; `accel.symmetry`): simulate one copy of traffic that
//! repeats itself host by host, or GPU by GPU. The packet model and the fluid model
//! ([`super::FluidSimulator::symmetry`]) both run through [`simulate_reduced`], which
//! finds the levels, has the innermost quotient simulated and expands its run.
//!
//! A collective over many hosts is often the same traffic on every host: in a ring
//! all-reduce on 16 hosts of 8 GPUs every host sends its NVLink steps and one step to the
//! next host, at the same times, through links that look alike. Shift every host by one
//! and the flow set, the routes and the fabric are unchanged. Simulating all 16 hosts then
//! computes the same packets 16 times. This module finds such a shift and simulates the
//! *quotient*: one flow per orbit, on one link per orbit, and hands every flow of an orbit
//! the completion of the one that was simulated. The quotient may have a symmetry of its
//! own (in that ring, shifting every GPU of a host to the next one, with the channels), so
//! the search runs again on it, and the copies multiply: that ring is simulated as the
//! flows of one GPU, 128 copies each. In a training step with tensor parallelism inside
//! hosts, the GPU shift alone often holds: it maps each tensor rank's data-parallel
//! groups and pipeline sends onto the next rank's, while the host shift fails on the
//! gradient norm's tree all-reduce.
//!
//! ## The group
//!
//! Candidates are rotations of hosts, then of the GPUs inside every host: hosts (or local
//! GPU indices) are cut into blocks of `b` consecutive ones (`b` divides their number,
//! largest first) and each moves to the next of its block, keeping its local index (or
//! its host). After those, each moves `s` places on within its block instead (`s`
//! divides `b`; orbits of `b / s`): a data-parallel group that takes every other GPU of a
//! host, the tensor ranks interleaved with it, is rotated by moving every GPU two places
//! (the 350M step on 128 GPUs, after the tensor ranks' shift and the hosts': 32 copies
//! instead of 8). The rotation acts on nodes through the structure of
//! the graph: a node at hop distance `d` from the nearest endpoint goes where its
//! neighbours at smaller distances go (the `i`-th of the nodes sharing those neighbours to
//! the `i`-th of the nodes sharing their images), so NVLink switches follow their hosts,
//! a rail leaf that sees one GPU of every host of the block stays put and a leaf of one
//! block of hosts moves with its block. Nodes that share their neighbours, such as the
//! spines that every leaf reaches alike, are told apart by the routes instead, where
//! they can be: a flow's image must take the image of its route, so each hop's ends go
//! to the ends of the image's hop (and the hop to that hop, which tells parallel cables
//! apart), and a node a route passes goes where its routes say;
//! a node whose neighbours nearer the endpoints are all placed but one, with one place
//! left among its image's, sends that one there, and the others of a class fill the
//! places left, in order. Pinned paths need this: the spine a path takes and its cable
//! among the parallel ones to that spine are digits of its destination's place on its
//! leaf, so moving every host of a pod two places on moves every path to the next spine,
//! and swapping neighbouring hosts moves each to the spine's other cable. With the
//! fabric's shape alone, only shifts that keep every path's spine and cable held, and
//! the GPT and Mixtral steps on 1,024 GPUs with pinned paths were reduced by 8 (the GPUs
//! of a host) instead of 128 and 256. A candidate is a symmetry only if all of these
//! hold, each checked exactly:
//! - it maps every link to a link between the images of its ends with the same bandwidth
//!   and delay (so the fabric is unchanged);
//! - it maps every flow to a flow with the images of its endpoints, the same bytes and
//!   release delay, and dependencies on the images of its dependencies (so the traffic is
//!   unchanged), one to one;
//! - every flow's image takes the image of its data route and of its reverse route (ECMP
//!   hashes are not symmetric in general, so this is checked route by route);
//! - every link a flow uses has an orbit of the full size `b` and no route uses two links
//!   of one orbit (then each link of the quotient carries exactly what each of its copies
//!   carries), and the links standing for consecutive hops of every route meet at one node;
//! - on a quotient, it maps every switch to one standing for as many copies.
//!
//! The first candidate that passes is used; if none does, the candidates are tried again
//! with exempt flows (below), and if none passes then either, the run is the plain one. A
//! candidate costs O(flows + dependencies + links) to check, and most fail at the flow
//! labels, before routes are compared.
//!
//! ## Exempt flows (`accel.symmetry_exempt`)
//!
//! A training step's gradient norm is an all-reduce of 4 bytes over each data-parallel
//! group, and NCCL runs it as a tree across hosts: the tree has a root, so no host shift
//! maps it onto itself, and that one collective of 2-byte flows kept every host shift of
//! the step from holding (the GPT 350M step on 128 GPUs reduced by 2 instead of 8; at
//! 1,024 GPUs the shift of the 32 hosts of a pipeline stage failed on it alone). The
//! second pass leaves the flows of at most one packet out of the check, when they are at
//! most one per hundred packets of the run:
//! - their labels are not computed, and they count as no one's dependency or dependent,
//!   so the other flows must map exactly as before, dependencies on other flows included;
//! - each is simulated on its own (every one of them is in the quotient), its routes
//!   folded onto the quotient's links like any other: it meets there the traffic of its
//!   own links' copy, which is the traffic its own links carry;
//! - a flow that waits for an exempt flow, directly or through others (the parameter
//!   all-gather after the norm), is simulated as the member of its orbit that the
//!   quotient stands for, and in the expanded run every member is released when its own
//!   dependencies finish and takes as long as that member did.
//!
//! What this approximates, and why it is small: exempt flows sent from other copies
//! share the quotient's links with each other, one frame each (a few tens of nanoseconds
//! at 400 Gb/s against the microseconds of their per-step latency); the switch buffer
//! counts their frames once per copy; the copies of a late flow run with the quotient's
//! timing (all at once) when they were in fact released some microseconds apart. That
//! last part is small only while each copy's late flows lag the flows simulated for them
//! by about one amount, so that the copy is the quotient shifted in time: the expansion
//! checks it, and when the lags within one copy spread by more than [`LAG_SPREAD`] of the
//! late flows' median duration, the quotient's run is set aside (its events still
//! counted, `PacketStats::symmetry_retried_events`) and that level is searched again
//! without exempt flows. A host shift passes (a host's chain delivers the norm to its
//! GPUs in the same order on every host); a GPU shift of a host whose chain delivers it
//! GPU after GPU does not.
//!
//! Byte totals and per-link bytes count each exempt flow once, on its own links; ECN, ACK
//! and other network counters are the quotient's multiplied by the copies (an exempt
//! flow's ACK counts once per copy), and trace samples of a late flow are its
//! stand-in's. `tests/accel.rs` checks the bounds on a step with a tree norm, and `orrery
//! bench --accel` measures the GPT steps.
//!
//! ## The quotient
//!
//! Each flow orbit is simulated as its member with the smallest source endpoint (the one
//! sent from the block's first host or GPU), on the lowest link of each link orbit,
//! depending on the flows standing for its dependencies' orbits, in an order that keeps
//! dependencies first. A switch that the rotation keeps in place (a rail leaf under the
//! host shift, a host's NVLink switch under the GPU shift) holds the packets of all `b` copies in the full
//! network, while the quotient puts only one copy's through it: its shared buffer counts
//! every byte `b / (its orbit size)` times ([`super::engine::SwitchBuf::copies`]), so its
//! dynamic PFC threshold and its tail drop see the full network's occupancy. Every other
//! mechanism (queues, ECN, PFC, DCQCN, and all other acceleration) runs on the quotient as
//! on any flow set.
//!
//! ## What is exact and what is not
//!
//! The flows simulated are those sent from each block's first host, on that host's own
//! links. Queue pairs that join a port at the same picosecond are served in the order of
//! their tie keys ([`super::host::tie_keys`]), which the shift keeps and the quotient's
//! flows carry over from the run's, so that host's ports serve the same queue pairs in
//! the same order as in the full run, and so does every other host's: the full run is
//! symmetric itself. Without ECN marking draws (queues below Kmin, or marking certain
//! above Kmax) every flow of the expanded run is then the full run's to the picosecond:
//! `tests/accel.rs` checks every one on a ring over four hosts, and on the 64 MiB ring
//! over 128 GPUs of `orrery bench --accel`, with both shifts and every other mechanism
//! off, all 260,096 are (`cargo run --release -p orrery-net --example ring_symmetry`).
//! With marking draws they are the full run with other draws, which is what another seed
//! gives, with one difference: every copy takes the simulated copy's draws, where the full
//! run draws for each copy's links on its own. Where a rare draw decides a large outcome
//! (DCQCN starving one of several queue pairs on one path), one copy of the full run may
//! draw it and the step wait for that copy, and the expanded run, all of whose copies
//! drew alike, does not. On the Mixtral step of `orrery bench --accel` (64 GPUs, x16) a
//! pipeline send converging with four relayed all-to-all blocks starved one block by
//! 650 us in one of the 16 copies; with symmetry the step ends 0.23% early at every seed
//! tried, without it (`accel.symmetry = false`) within 0.004% and with the straggler
//! (docs/benchmarks.md, 2026-12-07).
//!
//! Until 2026-12-05 such queue pairs were served in flow order, so on every host the
//! lowest-numbered ring channel went first while the shifts map each channel to the
//! next: on that ring single flows moved by 0.57% in mean and 22.2% at the 99th
//! percentile, as much as numbering the reference's own flows in another order moved
//! them (`orrery bench --accel --label-spread`, now 0 on it).
//!
//! The report expands the quotient: every flow of an orbit gets its simulated flow's start
//! and finish, every link of an orbit its link's bytes and pause frames, and the network's
//! counters (bytes, ACKs, ECN marks, CNPs, drops, retransmissions) are multiplied by `b`.
//! Counters of what the simulator did (events, jumps, memo lookups, virtual flows) are the
//! quotient's; [`super::PacketStats::symmetry_skipped_events`] estimates the events of the
//! copies not simulated as `b - 1` times the quotient's own (processed and skipped).
//!
//! ## What it does not do
//!
//! It looks for rotations of hosts and of the GPUs inside hosts only: not reflections,
//! not other permutations, not symmetries of part of the traffic (one asymmetric flow
//! of more than one packet leaves the whole run unreduced).

use super::engine::Routes;
use super::{PacketRun, PacketStats, TraceRequest};
use crate::flows::{dependency_order, Deps, FlowSet, FlowSpec};
use crate::sim::{FlowOutcome, SimError, SimProgress, SimReport};
use crate::topology::{mix, NetGraph};
use crate::word_hash::WordMap;
use orrery_units::{FlowId, LinkId, Picos};
use std::collections::VecDeque;

const NONE: u32 = u32::MAX;

/// One rotation the search found (see "The group" in the module essay): every host (or
/// every GPU of a host, by its local index) moves `stride` places on within its block of
/// `block` consecutive ones, giving `block / stride` copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct SymmetryShift {
    /// Hosts move (otherwise the GPUs inside every host do).
    pub across_hosts: bool,
    pub block: u32,
    pub stride: u32,
}

impl SymmetryShift {
    /// Copies of every flow simulated at this level.
    pub fn copies(&self) -> u32 {
        self.block / self.stride.max(1)
    }
}

impl std::fmt::Display for SymmetryShift {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = if self.across_hosts {
            "hosts"
        } else {
            "GPUs of each host"
        };
        let places = if self.stride == 1 { "place" } else { "places" };
        write!(
            f,
            "{what} {} {places} on in blocks of {} (x{})",
            self.stride,
            self.block,
            self.copies()
        )
    }
}

/// A symmetry found in a run: the quotient to simulate and how to expand its results.
#[derive(Debug)]
pub(super) struct Quotient {
    /// Copies of every simulated flow (the rotation's order, `b`).
    pub order: u32,
    /// The rotation that gives them.
    pub shift: SymmetryShift,
    /// For every flow of the run, its index in the quotient's flow set.
    pub flow_index: Vec<u32>,
    /// For every quotient flow, the flow of the run it is.
    pub reps: Vec<u32>,
    /// For every link, the link standing for its orbit.
    pub link_rep: Vec<u32>,
    /// The quotient's flows (the run's representatives, dependencies renumbered).
    pub flows: FlowSet,
    /// Their routes, on representative links.
    pub routes: Routes,
    /// Per node, the copies its buffer stands for.
    pub copies: Vec<u64>,
    /// Per quotient flow, the [`super::host::tie_keys`] of the run's flow it is (the
    /// quotient's own flows would hash otherwise: their dependents are representatives).
    pub ties: Vec<u64>,
    /// Per exempt flow (simulated each on its own), its bytes and the links of its data
    /// route (to count them on those links only).
    pub exempt_routes: Vec<(u64, Vec<u32>)>,
    /// The flows that wait, directly or not, for an exempt one, in id order: their times
    /// are carried through their dependencies instead of copied (see the module essay).
    pub late: Vec<LateFlow>,
}

/// A flow whose release follows its own dependencies in the expanded run.
#[derive(Debug)]
pub(super) struct LateFlow {
    pub flow: u32,
    /// Which copy of its orbit it is: the shift applied this many times to the flow
    /// simulated for the orbit gives it.
    pub copy: u32,
    /// Whether it is exempt itself (then it was simulated, and is its own stand-in).
    pub exempt: bool,
    pub deps: Vec<u32>,
    pub delay: Picos,
}

/// What a simulation of a quotient gives back, so that [`simulate_reduced`] can expand it
/// to the flow set the quotient was taken from: the packet model's [`PacketRun`], the
/// fluid model's report.
pub(super) trait ReducedRun: Sized {
    /// The events it processed (counted again in the run that replaces it, if it is set
    /// aside).
    fn events(&self) -> u64;
    /// The run the quotient `q` stands for, or `None` as for [`Quotient::expand`].
    fn expand(self, q: &Quotient) -> Option<Self>;
    /// Counts the events of runs simulated and set aside before this one as its own.
    fn add_retried_events(&mut self, events: u64);
}

impl ReducedRun for PacketRun {
    fn events(&self) -> u64 {
        self.report.events
    }

    fn expand(self, q: &Quotient) -> Option<Self> {
        q.expand(self)
    }

    fn add_retried_events(&mut self, events: u64) {
        self.report.events += events;
        self.stats.symmetry_retried_events += events;
    }
}

/// Simulates `flows` (on `routes`) through the symmetries found, or as they are when
/// `enabled` is false or none is found: each quotient is searched again for a symmetry of
/// its own, the innermost one is simulated by `simulate` (its flows, routes, buffer copies
/// per node and tie keys, the levels found, outermost first, and where to report
/// progress; the plain flow set with no levels), and its run is expanded level by level.
/// Levels are first searched with flows of at most `exempt_bytes` left out of the check
/// (0: strictly); a level whose late flows came out of step is searched again strictly
/// from there, and the run simulated again, its events counted in the final run. A
/// quotient's progress reaches `progress` as a share of the whole flow set (its flows
/// done scaled by the flows each stands for on average), so a bar over every flow fills.
#[allow(clippy::too_many_arguments)]
pub(super) fn simulate_reduced<R: ReducedRun>(
    graph: &NetGraph,
    flows: &FlowSet,
    routes: Routes,
    ties: &[u64],
    enabled: bool,
    exempt_bytes: u64,
    progress: &mut dyn FnMut(SimProgress),
    mut simulate: impl FnMut(
        &FlowSet,
        Routes,
        &[u64],
        &[u64],
        &[Quotient],
        &mut dyn FnMut(SimProgress),
    ) -> Result<R, SimError>,
) -> Result<R, SimError> {
    let ones = vec![1; graph.num_nodes()];
    let total = flows.flows.len();
    // Levels from `strict_from` on look only for symmetries that map every flow.
    let mut strict_from = usize::MAX;
    let mut retried_events = 0;
    let mut levels: Vec<Quotient> = Vec::new();
    loop {
        // The levels below one set aside still hold; the search goes on from them.
        loop {
            let exempt = if levels.len() < strict_from {
                exempt_bytes
            } else {
                0
            };
            let next = match levels.last() {
                _ if !enabled => None,
                Some(q) => find(graph, &q.flows, &q.routes, &q.copies, &q.ties, exempt),
                None => find(graph, flows, &routes, &ones, ties, exempt),
            };
            match next {
                Some(q) => levels.push(q),
                None => break,
            }
        }
        let Some(last) = levels.last() else {
            let mut run = simulate(flows, routes, &ones, ties, &[], progress)?;
            run.add_retried_events(retried_events);
            return Ok(run);
        };
        let stepped = last.flows.flows.len().max(1);
        let mut scaled = |p: SimProgress| {
            progress(SimProgress {
                flows_done: (p.flows_done as u128 * total as u128 / stepped as u128) as usize,
                flows_total: total,
                ..p
            })
        };
        let run = simulate(
            &last.flows,
            last.routes.clone(),
            &last.copies,
            &last.ties,
            &levels,
            &mut scaled,
        )?;
        let events = run.events();
        let mut expanded = Some(run);
        for (level, q) in levels.iter().enumerate().rev() {
            expanded = expanded.and_then(|run| run.expand(q));
            if expanded.is_none() {
                strict_from = level;
                break;
            }
        }
        match expanded {
            Some(mut run) => {
                run.add_retried_events(retried_events);
                return Ok(run);
            }
            None => {
                retried_events += events;
                levels.truncate(strict_from);
            }
        }
    }
}

/// The quotient of the first rotation (of hosts, then of GPUs inside every host) that is
/// a symmetry of `graph`, `flows`, `routes` and the buffer `copies` they already stand for
/// (see the module essay), or `None`. Rotations that map every flow are tried first; if
/// none does and `exempt_bytes` is not zero, they are tried again with the flows of at
/// most `exempt_bytes` left out of the check (see "Exempt flows" in the module essay).
pub(super) fn find(
    graph: &NetGraph,
    flows: &FlowSet,
    routes: &Routes,
    copies: &[u64],
    ties: &[u64],
    exempt_bytes: u64,
) -> Option<Quotient> {
    let per_host = graph.endpoints_per_host();
    let endpoints = graph.num_endpoints();
    if flows.flows.len() < 2 || !endpoints.is_multiple_of(per_host) {
        return None;
    }
    let hosts = endpoints / per_host;
    let layers = Layers::new(graph);
    // Each candidate moves every endpoint's (host, local GPU) index `i` `stride` places on
    // within its block of `block` (orbits of `block / stride`): across hosts first, then
    // across a host's GPUs; on each, steps of one first, largest blocks first, then longer
    // strides, for groups that take every other GPU of a host (tensor ranks interleaved
    // with data-parallel ones).
    let rotations = |count: usize, across_hosts: bool| {
        let blocks = move || (2..=count).rev().filter(move |&b| count.is_multiple_of(b));
        let unit = blocks().map(move |b| (b, 1, across_hosts));
        let strided = blocks().flat_map(move |b| {
            (2..b)
                .filter(move |&s| b.is_multiple_of(s))
                .map(move |s| (b, s, across_hosts))
        });
        unit.chain(strided)
    };
    let candidates: Vec<(usize, usize, bool)> = rotations(hosts, true)
        .chain(rotations(per_host, false))
        .collect();
    let first_that_holds = |keys: &FlowKeys| {
        candidates
            .iter()
            .find_map(|&(block, stride, across_hosts)| {
                let next = |i: usize| i - i % block + (i % block + stride) % block;
                let endpoint_image: Vec<u32> = (0..endpoints)
                    .map(|e| {
                        let (host, local) = (e / per_host, e % per_host);
                        let (host, local) = if across_hosts {
                            (next(host), local)
                        } else {
                            (host, next(local))
                        };
                        (host * per_host + local) as u32
                    })
                    .collect();
                let shift = Shift {
                    rotation: SymmetryShift {
                        across_hosts,
                        block: block as u32,
                        stride: stride as u32,
                    },
                    endpoint_image: &endpoint_image,
                    copies,
                    ties,
                };
                // The flow that broke the last candidate usually breaks this one too (the
                // tree of a gradient norm breaks every shift of hosts), and whether its image
                // has a counterpart at all is one lookup, where finding that out from the
                // labels takes a pass over most of the flows.
                if keys.counterpart_missing(flows, &endpoint_image) {
                    debug_assert!(quotient(graph, flows, routes, keys, &layers, &shift).is_none());
                    return None;
                }
                quotient(graph, flows, routes, keys, &layers, &shift)
            })
    };
    first_that_holds(&FlowKeys::new(flows, endpoints, Vec::new())).or_else(|| {
        let exempt = exempt_flows(flows, exempt_bytes)?;
        first_that_holds(&FlowKeys::new(flows, endpoints, exempt))
    })
}

/// The flows of at most `exempt_bytes` (one packet), if there are any and they are few:
/// at most one per hundred packets of the run, so that what folding them onto the
/// quotient's links adds (a frame where another copy's frame was) stays a small part of
/// every link's traffic.
fn exempt_flows(flows: &FlowSet, exempt_bytes: u64) -> Option<Vec<bool>> {
    if exempt_bytes == 0 {
        return None;
    }
    let exempt: Vec<bool> = flows
        .flows
        .iter()
        .map(|f| f.bytes.0 <= exempt_bytes)
        .collect();
    let count = exempt.iter().filter(|&&e| e).count() as u64;
    let packets: u64 = flows
        .flows
        .iter()
        .map(|f| f.bytes.0.div_ceil(exempt_bytes).max(1))
        .sum();
    let checked = exempt.len() as u64 - count;
    (count > 0 && checked >= 2 && count * 100 <= packets).then_some(exempt)
}

/// A candidate rotation, where it sends each endpoint, and the buffer copies of
/// the run it is tried on (which it must leave unchanged).
struct Shift<'a> {
    rotation: SymmetryShift,
    endpoint_image: &'a [u32],
    copies: &'a [u64],
    /// The run's [`super::host::tie_keys`], which the quotient's flows keep.
    ties: &'a [u64],
}

/// Structural labels of the flows, from which an image is found: a flow's *up* label
/// hashes its endpoints, bytes, delay and its dependencies' up labels; its *down* label
/// hashes its up label and its dependents' down labels. Each of those lists counts as a
/// multiset, the wrapping sum of its labels scrambled by [`mix`], which needs no sort: two
/// multisets share a sum only by a 64-bit accident, and a label only proposes an image,
/// which is then checked exactly. Flows alike in everything but
/// their identity (a ring's first steps on two channels between the same two GPUs) differ
/// in what depends on them, so the down label tells them apart. Exempt flows have no
/// labels and count as no one's dependency or dependent.
struct FlowKeys {
    /// Per flow, whether it is exempt from the check (empty: none is).
    exempt: Vec<bool>,
    /// Up labels of the run (to reject a candidate early).
    up: LabelFilter,
    /// Every checked flow's [`base_label`]: a flow whose image has none of these has no
    /// counterpart, whatever the dependencies.
    base: LabelFilter,
    /// The flow whose up label last rejected a candidate (see
    /// [`FlowKeys::counterpart_missing`]).
    last_reject: std::cell::Cell<Option<u32>>,
    /// The checked flows as `(down label, id)`, sorted: a candidate's flows, labelled and
    /// sorted the same way, pair off with these in order. Sorting rather than a table from
    /// label to flows, because a large run holds about one label per flow and such a table
    /// missed the cache on every insert and lookup: with it, `orrery netsim` of a 64 MiB
    /// ring over 128 GPUs (260,096 flows) took 77 to 78 ms, with the sorts 66 to 69 ms
    /// (`perf stat -r 30`, two runs each).
    by_down: Vec<(u64, u32)>,
    /// Dependents of every flow, in CSR form.
    dependents_at: Vec<u32>,
    dependents: Vec<u32>,
}

/// A flow's endpoints (renamed by `endpoint_image`), bytes and delay, hashed: what its
/// image must have in common with it, dependencies aside. `None` if an endpoint is out of
/// range.
fn base_label(f: &FlowSpec, endpoint_image: &[u32]) -> Option<u64> {
    let src = *endpoint_image.get(f.src as usize)?;
    let dst = *endpoint_image.get(f.dst as usize)?;
    Some(hash_label([
        u64::from(src),
        u64::from(dst),
        f.bytes.0,
        f.delay.0,
    ]))
}

/// A set of labels that can only say "no" for sure: a bit array with two bits per label
/// (a Bloom filter), two to four bytes per label, where a hash set of them would be ten
/// times that and miss the cache on every lookup of a large run. The search only asks it
/// to rule candidates out early: a label it wrongly claims leaves the candidate to the
/// down labels and the exact check, which rule it out all the same (the same answer, a
/// little later), and a label it denies is certainly absent.
struct LabelFilter {
    bits: Vec<u64>,
    /// Bit-index mask (the array holds a power of two of bits).
    mask: u64,
}

impl LabelFilter {
    /// A filter for up to `n` labels: at least 16 bits per label (a power of two in all),
    /// so that at most about one absent label in seventy passes.
    fn new(n: usize) -> LabelFilter {
        let bits = (n.max(4) * 16).next_power_of_two();
        LabelFilter {
            bits: vec![0; bits / 64],
            mask: bits as u64 - 1,
        }
    }

    /// The two bits of `label`, from its two halves (labels are already well mixed).
    fn bits_of(&self, label: u64) -> [u64; 2] {
        [label & self.mask, (label >> 32) & self.mask]
    }

    fn insert(&mut self, label: u64) {
        for b in self.bits_of(label) {
            self.bits[(b / 64) as usize] |= 1 << (b % 64);
        }
    }

    fn may_contain(&self, label: u64) -> bool {
        self.bits_of(label)
            .iter()
            .all(|&b| self.bits[(b / 64) as usize] & (1 << (b % 64)) != 0)
    }
}

/// Sorts `v`. Most flows wait for one flow or none, and for those the call into the sort
/// costs more than the comparison it prepares, so it is skipped.
fn sort_short<T: Ord>(v: &mut [T]) {
    if v.len() > 1 {
        v.sort_unstable();
    }
}

/// The pairs `(labels[i], i)` for the `i` that `keep`, sorted. Labels are hashes, spread
/// evenly over 64 bits, so one pass files the pairs into buckets by their top bits
/// (about four pairs per bucket, the ids ascending in each as they came) and each bucket
/// is then sorted on its own: two passes over memory where a comparison sort makes about
/// eighteen. Labels that are not spread (a test's hand-made ones) still come out sorted,
/// only more slowly.
fn sort_labelled(labels: &[u64], keep: impl Fn(usize) -> bool) -> Vec<(u64, u32)> {
    let n = labels.len();
    let kept = || (labels.iter().enumerate()).filter(|&(i, _)| keep(i));
    if n < 4096 {
        let mut pairs: Vec<(u64, u32)> = kept().map(|(i, &l)| (l, i as u32)).collect();
        pairs.sort_unstable();
        return pairs;
    }
    let bits = (usize::BITS - (n / 4).leading_zeros()).min(20);
    let shift = 64 - bits;
    let bucket = |l: u64| (l >> shift) as usize;
    let mut start = vec![0u32; (1 << bits) + 1];
    for (_, &l) in kept() {
        start[bucket(l) + 1] += 1;
    }
    for b in 0..1 << bits {
        start[b + 1] += start[b];
    }
    let mut fill = start.clone();
    let mut sorted = vec![(0u64, 0u32); start[1 << bits] as usize];
    for (i, &l) in kept() {
        let at = &mut fill[bucket(l)];
        sorted[*at as usize] = (l, i as u32);
        *at += 1;
    }
    for b in start.windows(2) {
        insertion_sort(&mut sorted[b[0] as usize..b[1] as usize]);
    }
    sorted
}

/// Sorts a bucket of [`sort_labelled`]: a handful of pairs, too few for the library's
/// sort to pay for its call (larger buckets, from labels that are not spread, go to it).
fn insertion_sort(v: &mut [(u64, u32)]) {
    if v.len() > 32 {
        v.sort_unstable();
        return;
    }
    for i in 1..v.len() {
        let x = v[i];
        let mut j = i;
        while j > 0 && v[j - 1] > x {
            v[j] = v[j - 1];
            j -= 1;
        }
        v[j] = x;
    }
}

fn hash_label(words: impl IntoIterator<Item = u64>) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for w in words {
        h ^= w;
        h = h.wrapping_mul(0x0000_0100_0000_01b3).rotate_left(29);
    }
    h ^ (h >> 31)
}

impl FlowKeys {
    fn new(flows: &FlowSet, endpoints: usize, exempt: Vec<bool>) -> FlowKeys {
        let n = flows.flows.len();
        let mut count = vec![0u32; n + 1];
        for f in &flows.flows {
            for d in &f.deps {
                count[d.index() + 1] += 1;
            }
        }
        for i in 0..n {
            count[i + 1] += count[i];
        }
        let mut fill = count.clone();
        let mut dependents = vec![0u32; count[n] as usize];
        for (i, f) in flows.flows.iter().enumerate() {
            for d in &f.deps {
                dependents[fill[d.index()] as usize] = i as u32;
                fill[d.index()] += 1;
            }
        }
        let mut keys = FlowKeys {
            exempt,
            up: LabelFilter::new(n),
            base: LabelFilter::new(n),
            last_reject: std::cell::Cell::new(None),
            by_down: Vec::new(),
            dependents_at: count,
            dependents,
        };
        let identity: Vec<u32> = (0..endpoints as u32).collect();
        let up = keys.up_labels(flows, &identity, false).unwrap_or_default();
        let down = keys.down_labels(&up);
        for (i, &l) in up.iter().enumerate() {
            if !keys.is_exempt(i) {
                keys.up.insert(l);
            }
        }
        keys.by_down = keys.sorted_by_label(&down);
        for (i, f) in flows.flows.iter().enumerate() {
            if let Some(l) = base_label(f, &identity).filter(|_| !keys.is_exempt(i)) {
                keys.base.insert(l);
            }
        }
        keys
    }

    /// Whether the flow that last rejected a candidate in [`FlowKeys::up_labels`] maps,
    /// under `endpoint_image`, to no flow with the same endpoints, bytes and delay: then
    /// no image of the flows exists (equal flows hash alike, so a label that `base` denies
    /// is a counterpart missing; one it may contain proves nothing).
    fn counterpart_missing(&self, flows: &FlowSet, endpoint_image: &[u32]) -> bool {
        let Some(f) = self
            .last_reject
            .get()
            .and_then(|f| flows.flows.get(f as usize))
        else {
            return false;
        };
        base_label(f, endpoint_image).is_some_and(|l| !self.base.may_contain(l))
    }

    fn is_exempt(&self, flow: usize) -> bool {
        self.exempt.get(flow).copied().unwrap_or(false)
    }

    /// The checked flows as `(label, id)` pairs sorted, given every flow's label.
    fn sorted_by_label(&self, labels: &[u64]) -> Vec<(u64, u32)> {
        sort_labelled(labels, |i| !self.is_exempt(i))
    }

    /// Up labels with endpoints renamed by `endpoint_image`; with `check`, `None` as soon
    /// as a label is certainly not one of the run's own (the filter lets a few absent ones
    /// pass, which the down labels or the exact check then rule out).
    fn up_labels(&self, flows: &FlowSet, endpoint_image: &[u32], check: bool) -> Option<Vec<u64>> {
        let mut up = Vec::with_capacity(flows.flows.len());
        for (i, f) in flows.flows.iter().enumerate() {
            if self.is_exempt(i) {
                up.push(0);
                continue;
            }
            let (count, below) = f
                .deps
                .iter()
                .filter(|d| !self.is_exempt(d.index()))
                .fold((0u64, 0u64), |(n, sum), d| {
                    (n + 1, sum.wrapping_add(mix(up[d.index()])))
                });
            let (src, dst) = (
                *endpoint_image.get(f.src as usize)?,
                *endpoint_image.get(f.dst as usize)?,
            );
            let l = hash_label([
                u64::from(src),
                u64::from(dst),
                f.bytes.0,
                f.delay.0,
                count,
                below,
            ]);
            if check && !self.up.may_contain(l) {
                self.last_reject.set(Some(i as u32));
                return None;
            }
            up.push(l);
        }
        Some(up)
    }

    fn down_labels(&self, up: &[u64]) -> Vec<u64> {
        let mut down = vec![0u64; up.len()];
        for i in (0..up.len()).rev() {
            if self.is_exempt(i) {
                continue;
            }
            let (a, b) = (
                self.dependents_at[i] as usize,
                self.dependents_at[i + 1] as usize,
            );
            let (count, above) = self.dependents[a..b]
                .iter()
                .filter(|&&g| !self.is_exempt(g as usize))
                .fold((0u64, 0u64), |(n, sum), &g| {
                    (n + 1, sum.wrapping_add(mix(down[g as usize])))
                });
            down[i] = hash_label([up[i], count, above]);
        }
        down
    }
}

/// Nodes by hop distance from the nearest endpoint (over links either way), and each
/// node's neighbours one layer closer.
struct Layers {
    layer: Vec<u32>,
    lower: Vec<Vec<u32>>,
}

impl Layers {
    fn new(graph: &NetGraph) -> Layers {
        let n = graph.num_nodes();
        let mut adj: Vec<Vec<u32>> = vec![Vec::new(); n];
        for l in graph.links() {
            adj[l.from.index()].push(l.to.0);
            adj[l.to.index()].push(l.from.0);
        }
        let mut layer = vec![NONE; n];
        let mut q = VecDeque::new();
        for e in 0..graph.num_endpoints() {
            if let Ok(node) = graph.endpoint(e) {
                layer[node.index()] = 0;
                q.push_back(node.0);
            }
        }
        while let Some(v) = q.pop_front() {
            for &u in &adj[v as usize] {
                if layer[u as usize] == NONE {
                    layer[u as usize] = layer[v as usize] + 1;
                    q.push_back(u);
                }
            }
        }
        let lower = (0..n)
            .map(|v| {
                let mut below: Vec<u32> = adj[v]
                    .iter()
                    .copied()
                    .filter(|&u| layer[v] != NONE && layer[u as usize] < layer[v])
                    .collect();
                sort_short(below.as_mut_slice());
                below.dedup();
                below
            })
            .collect();
        Layers { layer, lower }
    }
}

/// The node permutation that `endpoint_image` (on endpoint indices) induces, layer by
/// layer (see the module essay), or `None` if it is not one. `hint` (`NONE` where it
/// says nothing) is where the routes send each node they pass (see [`route_hints`]): a
/// node with a hint goes there if that is among the nodes its class may go to, and the
/// others of its class take the remaining places in order.
fn node_image(
    graph: &NetGraph,
    layers: &Layers,
    endpoint_image: &[u32],
    hint: Option<&[u32]>,
) -> Option<Vec<u32>> {
    let n = graph.num_nodes();
    let mut image = vec![NONE; n];
    for (e, &to) in endpoint_image.iter().enumerate() {
        image[graph.endpoint(e).ok()?.index()] = graph.endpoint(to as usize).ok()?.0;
    }
    let hint_of = |v: u32| hint.map_or(NONE, |h| h[v as usize]);
    if (0..n as u32)
        .any(|v| hint_of(v) != NONE && image[v as usize] != NONE && hint_of(v) != image[v as usize])
    {
        return None;
    }
    let top = layers.layer.iter().copied().filter(|&d| d != NONE).max()?;
    let mut taken = vec![false; n];
    for d in 1..=top {
        let at: Vec<u32> = (0..n as u32)
            .filter(|&v| layers.layer[v as usize] == d)
            .collect();
        let class_key = |kind, below: &[u32]| (kind, below.to_vec());
        let mut classes: WordMap<_, Vec<u32>> = WordMap::default();
        for &v in &at {
            let kind = graph.kind(orrery_units::NodeId(v));
            classes
                .entry(class_key(kind, &layers.lower[v as usize]))
                .or_default()
                .push(v);
        }
        // Class by class, in node order: the hinted members first, then the rest in order
        // onto the places left.
        for &first in &at {
            if image[first as usize] != NONE {
                continue;
            }
            let kind = graph.kind(orrery_units::NodeId(first));
            let own = &classes[&class_key(kind, &layers.lower[first as usize])];
            let mut moved: Vec<u32> = layers.lower[first as usize]
                .iter()
                .map(|&u| image[u as usize])
                .collect();
            moved.sort_unstable();
            let target = classes.get(&(kind, moved))?;
            if target.len() != own.len() {
                return None;
            }
            for &v in own {
                let h = hint_of(v);
                if h != NONE {
                    if !target.contains(&h) || std::mem::replace(&mut taken[h as usize], true) {
                        return None;
                    }
                    image[v as usize] = h;
                }
            }
            let free: Vec<u32> = target
                .iter()
                .copied()
                .filter(|&w| !taken[w as usize])
                .collect();
            let unhinted: Vec<u32> = own
                .iter()
                .copied()
                .filter(|&v| image[v as usize] == NONE)
                .collect();
            for (&v, &w) in unhinted.iter().zip(&free) {
                taken[w as usize] = true;
                image[v as usize] = w;
            }
        }
    }
    // Nodes no endpoint reaches stay put; the whole map must be a permutation.
    let mut seen = vec![false; n];
    for (v, slot) in image.iter_mut().enumerate() {
        if *slot == NONE {
            *slot = v as u32;
        }
        if std::mem::replace(&mut seen[*slot as usize], true) {
            return None;
        }
    }
    Some(image)
}

/// Where the routes send the nodes they pass, or `None` if they contradict themselves:
/// a flow's image must take the image of its route hop by hop, so each hop's ends must go
/// to the ends of the image's hop. Pinned paths need this: the spine a path takes is a
/// digit of its destination's place on its leaf, so a shift of hosts by two places moves
/// every path to the next spine, which nothing in the fabric's shape says (every spine
/// sees every leaf alike).
fn route_hints(
    graph: &NetGraph,
    routes: &Routes,
    flow_image: &[u32],
    exempt: impl Fn(usize) -> bool,
) -> Option<RouteHints> {
    let mut hints = RouteHints {
        nodes: vec![NONE; graph.num_nodes()],
        links: vec![NONE; graph.links().len()],
    };
    let set = |hint: &mut [u32], v: usize, to: u32| {
        let old = std::mem::replace(&mut hint[v], to);
        old == NONE || old == to
    };
    for (f, &g) in flow_image.iter().enumerate() {
        if exempt(f) {
            continue;
        }
        let (fwd, rev) = routes.of(f);
        let (gfwd, grev) = routes.of(g as usize);
        if fwd.len() != gfwd.len() || rev.len() != grev.len() {
            return None;
        }
        for (&x, &y) in fwd.iter().zip(gfwd).chain(rev.iter().zip(grev)) {
            let (a, b) = (graph.link(LinkId(x)), graph.link(LinkId(y)));
            if !set(&mut hints.nodes, a.from.index(), b.from.0)
                || !set(&mut hints.nodes, a.to.index(), b.to.0)
                || !set(&mut hints.links, x as usize, y)
            {
                return None;
            }
        }
    }
    Some(hints)
}

/// Where the routes send the nodes and links they pass (`NONE` where they say nothing).
struct RouteHints {
    nodes: Vec<u32>,
    links: Vec<u32>,
}

/// Completes `hint` where the routes leave one choice: a node going to `h` must take its
/// neighbours nearer the endpoints onto `h`'s, so if all of them but one are placed and
/// one of `h`'s is left, that one is where the last goes. A quotient's routes are folded
/// onto one copy's links and pass only some of the switches: in a 3-tier fat-tree a core
/// switch on them reaches the aggregation switch of the pod they pass and that of a pod
/// they do not, and the second's place follows from the first's.
fn complete_hints(layers: &Layers, hint: &mut [u32]) {
    let mut changed = true;
    while changed {
        changed = false;
        for v in 0..hint.len() {
            let h = hint[v];
            if h == NONE {
                continue;
            }
            let (below, theirs) = (&layers.lower[v], &layers.lower[h as usize]);
            if below.len() != theirs.len() {
                continue;
            }
            let mut open = below.iter().filter(|&&u| hint[u as usize] == NONE);
            let (Some(&u), None) = (open.next(), open.next()) else {
                continue;
            };
            let mut left = theirs
                .iter()
                .filter(|&&w| !below.iter().any(|&x| hint[x as usize] == w));
            if let (Some(&w), None) = (left.next(), left.next()) {
                hint[u as usize] = w;
                changed = true;
            }
        }
    }
}

/// The link permutation the node permutation induces, or `None`: the links from `a` to `b`
/// go to those from `a'` to `b'` with the same bandwidth and delay, each link a route
/// passes where its routes send it (`hint`, see [`route_hints`]; parallel cables under
/// pinned paths are numbered by the destination's place on its leaf, so a shift of hosts
/// may move a path to another cable of the same pair of switches), the others in order
/// onto the places left (the `i`-th to the `i`-th when nothing is hinted).
fn link_image(graph: &NetGraph, nodes: &[u32], hint: &[u32]) -> Option<Vec<u32>> {
    let links = graph.links();
    let mut between: WordMap<(u32, u32), Vec<u32>> = WordMap::default();
    for (i, l) in links.iter().enumerate() {
        between
            .entry((l.from.0, l.to.0))
            .or_default()
            .push(i as u32);
    }
    let mut image = vec![NONE; links.len()];
    let mut taken = vec![false; links.len()];
    for (i, l) in links.iter().enumerate() {
        if image[i] != NONE {
            continue;
        }
        let own = &between[&(l.from.0, l.to.0)];
        let to = between.get(&(nodes[l.from.index()], nodes[l.to.index()]))?;
        if to.len() != own.len() {
            return None;
        }
        for &x in own {
            let h = hint[x as usize];
            if h != NONE {
                if !to.contains(&h) || std::mem::replace(&mut taken[h as usize], true) {
                    return None;
                }
                image[x as usize] = h;
            }
        }
        let free: Vec<u32> = to.iter().copied().filter(|&w| !taken[w as usize]).collect();
        let unhinted: Vec<u32> = own
            .iter()
            .copied()
            .filter(|&x| image[x as usize] == NONE)
            .collect();
        for (&x, &w) in unhinted.iter().zip(&free) {
            taken[w as usize] = true;
            image[x as usize] = w;
        }
    }
    let alike = |(i, &m): (usize, &u32)| {
        let (l, ml) = (&links[i], graph.link(LinkId(m)));
        ml.bandwidth == l.bandwidth && ml.delay == l.delay
    };
    image.iter().enumerate().all(alike).then_some(image)
}

/// The flow permutation, or `None` (see the module essay): flows go to the flows with
/// their labels under the endpoint renaming (the `k`-th of equal ones to the `k`-th), and
/// the result is then checked exactly. Exempt flows stay where they are, and are left
/// out of the dependencies compared.
fn flow_image(flows: &FlowSet, keys: &FlowKeys, endpoint_image: &[u32]) -> Option<Vec<u32>> {
    let n = flows.flows.len();
    let up = keys.up_labels(flows, endpoint_image, true)?;
    let down = keys.down_labels(&up);
    // The k-th flow of the candidate in (label, id) order maps to the k-th of the run:
    // among flows of one label, the lowest id to the lowest.
    let mut image: Vec<u32> = (0..n as u32).collect();
    let labelled = keys.sorted_by_label(&down);
    if labelled.len() != keys.by_down.len() {
        return None;
    }
    for (&(l, i), &(m, j)) in labelled.iter().zip(&keys.by_down) {
        if l != m {
            return None;
        }
        image[i as usize] = j;
    }
    // Exact check: a bijection that renames endpoints and maps dependencies onto
    // dependencies, with bytes and delays kept.
    let mut taken = vec![false; n];
    let mut mine = Vec::new();
    let mut theirs = Vec::new();
    let checked = |d: &&FlowId| !keys.is_exempt(d.index());
    for (i, f) in flows.flows.iter().enumerate() {
        if keys.is_exempt(i) {
            continue;
        }
        let g = image[i] as usize;
        let o = &flows.flows[g];
        if std::mem::replace(&mut taken[g], true)
            || endpoint_image.get(f.src as usize) != Some(&o.src)
            || endpoint_image.get(f.dst as usize) != Some(&o.dst)
            || f.bytes != o.bytes
            || f.delay != o.delay
        {
            return None;
        }
        mine.clear();
        mine.extend(f.deps.iter().filter(checked).map(|d| image[d.index()]));
        sort_short(mine.as_mut_slice());
        theirs.clear();
        theirs.extend(o.deps.iter().filter(checked).map(|d| d.0));
        sort_short(theirs.as_mut_slice());
        if mine != theirs {
            return None;
        }
    }
    Some(image)
}

/// Orbit representatives of the permutation `image` (the member with the smallest `key`),
/// if every orbit holding a `wanted` element has exactly `order` members.
fn orbit_reps<K: Ord>(
    image: &[u32],
    order: u32,
    wanted: impl Fn(usize) -> bool,
    key: impl Fn(u32) -> K,
) -> Option<Vec<u32>> {
    let mut rep = vec![NONE; image.len()];
    let mut members = Vec::new();
    for start in 0..image.len() {
        if rep[start] != NONE {
            continue;
        }
        members.clear();
        members.push(start as u32);
        let mut at = *image.get(start)?;
        while at != start as u32 {
            members.push(at);
            at = *image.get(at as usize)?;
        }
        if members.len() != order as usize && members.iter().any(|&m| wanted(m as usize)) {
            return None;
        }
        let best = members.iter().copied().min_by_key(|&m| key(m))?;
        for &m in &members {
            rep[m as usize] = best;
        }
    }
    Some(rep)
}

/// The representatives in an order where every one comes after those standing for its
/// dependencies (the lowest flow id first among those ready). The orbit graph has no
/// cycle: every member of an orbit is released at the same time in the symmetric run, so
/// an orbit waits only for orbits that finished before it started.
fn quotient_order(flows: &FlowSet, flow_rep: &[u32], reps: &[u32]) -> Option<Vec<u32>> {
    // `reps` ascend, so a position's order is its flow's.
    let mut position = vec![NONE; flow_rep.len()];
    for (k, &r) in reps.iter().enumerate() {
        *position.get_mut(r as usize)? = k as u32;
    }
    // Each representative's dependencies as positions (every orbit's representative has
    // one, so a missing one is no quotient).
    let mut forward = true;
    for (k, &r) in reps.iter().enumerate() {
        for d in &flows.flows.get(r as usize)?.deps {
            let p = *position.get(*flow_rep.get(d.index())? as usize)?;
            if p == NONE {
                return None;
            }
            forward &= (p as usize) < k;
        }
    }
    // When every orbit waits only for orbits of lower positions, the lowest-first order is
    // the positions' own (position `k` is ready once `0..k` are out, and is then the
    // lowest left), so the topological sort is skipped; the test
    // `a_forward_quotient_keeps_the_representatives_order` holds the two to agree.
    if forward {
        return Some(reps.to_vec());
    }
    let deps = |k: usize| {
        flows.flows[reps[k] as usize]
            .deps
            .iter()
            .map(|d| position[flow_rep[d.index()] as usize] as usize)
            .collect()
    };
    let order = dependency_order(reps.len(), deps, false)?;
    Some(order.into_iter().map(|k| reps[k]).collect())
}

fn quotient(
    graph: &NetGraph,
    flows: &FlowSet,
    routes: &Routes,
    keys: &FlowKeys,
    layers: &Layers,
    shift: &Shift,
) -> Option<Quotient> {
    let order = shift.rotation.copies();
    // The fabric's shape alone first: most candidates that fail do so here or at the flow
    // labels, before the routes are read.
    let shaped = node_image(graph, layers, shift.endpoint_image, None)?;
    let fimg = flow_image(flows, keys, shift.endpoint_image)?;
    let mut hints = route_hints(graph, routes, &fimg, |f| keys.is_exempt(f))?;
    complete_hints(layers, &mut hints.nodes);
    let agrees = (hints.nodes.iter().zip(&shaped)).all(|(&h, &s)| h == NONE || h == s);
    let nodes = if agrees {
        shaped
    } else {
        node_image(graph, layers, shift.endpoint_image, Some(&hints.nodes))?
    };
    // Switches standing for other numbers of copies are not alike.
    if (0..nodes.len()).any(|v| shift.copies[nodes[v] as usize] != shift.copies[v]) {
        return None;
    }
    let links = link_image(graph, &nodes, &hints.links)?;
    let mut used = vec![false; links.len()];
    for (f, &g) in fimg.iter().enumerate() {
        if keys.is_exempt(f) {
            continue;
        }
        let (fwd, rev) = routes.of(f);
        let (gfwd, grev) = routes.of(g as usize);
        let maps = |a: &[u32], b: &[u32]| {
            a.len() == b.len() && a.iter().zip(b).all(|(&x, &y)| links[x as usize] == y)
        };
        if !maps(fwd, gfwd) || !maps(rev, grev) {
            return None;
        }
        for &l in fwd.iter().chain(rev) {
            used[l as usize] = true;
        }
    }
    // A flow orbit is simulated as its member sent from the block's first host, so the
    // quotient's flows on that host's ports are the full run's, in the same order (the
    // order queue pairs share a port in); links and nodes stand as their lowest member,
    // which for a host's own links is the first host's.
    let flow_rep = orbit_reps(
        &fimg,
        order,
        |f| !keys.is_exempt(f),
        |f| (flows.flows[f as usize].src, f),
    )?;
    let link_rep = orbit_reps(&links, order, |l| used[l], |l| l)?;
    let node_rep = orbit_reps(&nodes, order, |_| false, |v| v)?;
    let reps: Vec<u32> = (0..fimg.len() as u32)
        .filter(|&f| flow_rep[f as usize] == f)
        .collect();
    let reps = quotient_order(flows, &flow_rep, &reps)?;
    let mut index_of_rep = vec![NONE; fimg.len()];
    for (k, &r) in reps.iter().enumerate() {
        index_of_rep[r as usize] = k as u32;
    }
    let flow_index: Vec<u32> = flow_rep.iter().map(|&r| index_of_rep[r as usize]).collect();
    let mut q_routes = Routes::default();
    let mut q_flows = Vec::with_capacity(reps.len());
    for &r in &reps {
        let (fwd, rev) = routes.of(r as usize);
        for (path, forward) in [(fwd, true), (rev, false)] {
            let start = q_routes.paths.len();
            q_routes
                .paths
                .extend(path.iter().map(|&l| link_rep[l as usize]));
            let mapped = &q_routes.paths[start..];
            // One link per orbit on a route, and consecutive hops meeting at one node.
            for (i, &l) in mapped.iter().enumerate() {
                if mapped[..i].contains(&l) {
                    return None;
                }
                if let Some(&next) = mapped.get(i + 1) {
                    if graph.link(LinkId(l)).to != graph.link(LinkId(next)).from {
                        return None;
                    }
                }
            }
            let span = (start as u32, mapped.len() as u32);
            if forward {
                q_routes.fwd.push(span);
            } else {
                q_routes.rev.push(span);
            }
        }
        let f = &flows.flows[r as usize];
        let mut deps: Deps = f
            .deps
            .iter()
            .map(|d| FlowId(flow_index[d.index()]))
            .collect();
        sort_short(deps.as_mut_slice());
        deps.dedup();
        q_flows.push(FlowSpec {
            src: f.src,
            dst: f.dst,
            bytes: f.bytes,
            deps,
            delay: f.delay,
            collective: f.collective,
        });
    }
    let mut orbit_size = vec![0u64; nodes.len()];
    for &r in &node_rep {
        orbit_size[r as usize] += 1;
    }
    // A switch's buffer stands for `order / orbit` copies, so its orbit must divide the
    // order. Switches on routes do (their links' orbits have the full order); a node map
    // taken from the routes could give any other switch an orbit that does not.
    if orbit_size
        .iter()
        .any(|&k| k > 0 && !u64::from(order).is_multiple_of(k))
    {
        return None;
    }
    let copies = node_rep
        .iter()
        .zip(shift.copies)
        .map(|(&r, &c)| c * (u64::from(order) / orbit_size[r as usize].max(1)))
        .collect();
    // The flows that wait for an exempt flow, directly or not (none without exempt
    // flows, and then the pass over the flows is skipped), with the copy of its orbit
    // each is: how many times the shift takes the orbit's representative to it.
    let mut late = Vec::new();
    if keys.exempt.iter().any(|&e| e) {
        let copy_of = |f: usize| {
            let (mut at, mut k) = (flow_rep[f], 0);
            while at != f as u32 {
                at = fimg[at as usize];
                k += 1;
            }
            k
        };
        let mut waits_for_exempt = vec![false; flows.flows.len()];
        for (i, f) in flows.flows.iter().enumerate() {
            if f.deps
                .iter()
                .any(|d| keys.is_exempt(d.index()) || waits_for_exempt[d.index()])
            {
                waits_for_exempt[i] = true;
                late.push(LateFlow {
                    flow: i as u32,
                    copy: copy_of(i),
                    exempt: keys.is_exempt(i),
                    deps: f.deps.iter().map(|d| d.0).collect(),
                    delay: f.delay,
                });
            }
        }
    }
    let ties = reps
        .iter()
        .map(|&r| shift.ties.get(r as usize).copied().unwrap_or(0))
        .collect();
    let exempt_routes: Vec<(u64, Vec<u32>)> = (0..flows.flows.len())
        .filter(|&i| keys.is_exempt(i))
        .map(|i| (flows.flows[i].bytes.0, routes.of(i).0.to_vec()))
        .collect();
    Some(Quotient {
        exempt_routes,
        late,
        order,
        shift: shift.rotation,
        flow_index,
        reps,
        link_rep,
        flows: FlowSet {
            flows: q_flows,
            collectives: flows.collectives.clone(),
        },
        routes: q_routes,
        copies,
        ties,
    })
}

impl Quotient {
    /// `trace` on the quotient: each requested port replaced by its orbit's link.
    pub fn trace(&self, trace: &TraceRequest) -> TraceRequest {
        TraceRequest {
            interval: trace.interval,
            ports: trace
                .ports
                .iter()
                .map(|l| LinkId(self.link_rep.get(l.index()).copied().unwrap_or(l.0)))
                .collect(),
            flows: trace.flows,
        }
    }

    /// A per-flow quantity of the quotient's flows for every flow of the run: each flow
    /// gets the value of the flow that stands for its orbit.
    fn per_flow<T: Copy>(&self, v: &[T]) -> Vec<T> {
        self.flow_index.iter().map(|&k| v[k as usize]).collect()
    }

    /// The run of the full flow set that the quotient's `run` stands for (see the module
    /// essay for what is copied, what is multiplied and what is the quotient's own), or
    /// `None` when flows waiting for exempt ones were released out of step with their
    /// copy (see [`LAG_SPREAD`]).
    pub fn expand(&self, run: PacketRun) -> Option<PacketRun> {
        let b = u64::from(self.order);
        let mut report = self.expand_report(run.report)?;
        let s = run.stats;
        // The copies of this level cost what the level below cost, its own copies included.
        let symmetry_skipped_events = (b - 1) * (report.events + s.total_skipped_events());
        let stats = PacketStats {
            ecn_marks: s.ecn_marks * b,
            cnps: s.cnps * b,
            acks: s.acks * b,
            nacks: s.nacks * b,
            go_backs: s.go_backs * b,
            timeouts: s.timeouts * b,
            retransmitted_bytes: s.retransmitted_bytes * b,
            // A quotient of a quotient: the copies multiply, and the flows simulated are
            // the innermost one's.
            symmetry_order: b * s.symmetry_order.max(1),
            symmetry_flows: if s.symmetry_order > 1 {
                s.symmetry_flows
            } else {
                self.reps.len() as u64
            },
            symmetry_skipped_events: symmetry_skipped_events + s.symmetry_skipped_events,
            symmetry_exempt_flows: self.exempt_routes.len() as u64 + s.symmetry_exempt_flows,
            symmetry_late_flows: self.late.len() as u64 + s.symmetry_late_flows,
            ..s
        };
        report.accel.skipped_events = stats.total_skipped_events();
        let samples = run
            .samples
            .into_iter()
            .map(|mut sample| {
                // Samples without per-flow vectors keep them empty.
                if !sample.delivered.is_empty() {
                    sample.delivered = self.per_flow(&sample.delivered);
                    sample.rate = self.per_flow(&sample.rate);
                }
                sample
            })
            .collect();
        // A flow's own events are those of the flow that was simulated; its copies have
        // none, as memo hits have none.
        let mut flow_events = vec![0; self.flow_index.len()];
        for (k, &r) in self.reps.iter().enumerate() {
            flow_events[r as usize] = run.flow_events[k];
        }
        let mut symmetry = vec![self.shift];
        symmetry.extend(run.symmetry);
        Some(PacketRun {
            report,
            stats,
            samples,
            flow_events,
            symmetry,
        })
    }

    /// The report of the full flow set that the quotient's `report` stands for: every
    /// flow the outcome of the one simulated for its orbit (flows waiting for exempt ones
    /// timed through their dependencies), per-link figures copied from each orbit's link,
    /// totals multiplied by the copies (exempt flows' bytes counted once), its events the
    /// quotient's; `None` as for [`Quotient::expand`]. What the fluid model expands.
    pub fn expand_report(&self, mut report: SimReport) -> Option<SimReport> {
        let b = u64::from(self.order);
        let per_link =
            |v: &[u64]| -> Vec<u64> { self.link_rep.iter().map(|&r| v[r as usize]).collect() };
        let simulated = std::mem::take(&mut report.flows);
        report.flows = self.per_flow(&simulated);
        // A flow waiting for an exempt one is released when its own dependencies finish,
        // and takes as long as the flow simulated for it did.
        for late in &self.late {
            let stand_in = simulated[self.flow_index[late.flow as usize] as usize];
            let ready = late
                .deps
                .iter()
                .map(|&d| report.flows[d as usize].finish)
                .max()
                .unwrap_or(Picos::ZERO);
            let start = Picos(ready.0.saturating_add(late.delay.0));
            report.flows[late.flow as usize] = FlowOutcome {
                start,
                finish: Picos(start.0.saturating_add(stand_in.fct().0)),
            };
        }
        if !self.lags_agree(&simulated, &report.flows) {
            return None;
        }
        if !self.late.is_empty() {
            report.end = report
                .flows
                .iter()
                .map(|f| f.finish)
                .max()
                .unwrap_or(report.end);
        }
        report.link_bytes = per_link(&report.link_bytes);
        // Each exempt flow's bytes went over its orbit's links once, and were copied to
        // every link of those orbits: they belong to its own links only.
        if !self.exempt_routes.is_empty() {
            let mut folded = vec![0u64; self.link_rep.len()];
            for (bytes, path) in &self.exempt_routes {
                for &l in path {
                    folded[self.link_rep[l as usize] as usize] += bytes;
                }
            }
            for (l, b) in report.link_bytes.iter_mut().enumerate() {
                *b = b.saturating_sub(folded[self.link_rep[l] as usize]);
            }
            for (bytes, path) in &self.exempt_routes {
                for &l in path {
                    report.link_bytes[l as usize] += bytes;
                }
            }
        }
        report.pfc_pauses = per_link(&report.pfc_pauses);
        report.drops *= b;
        // Exempt flows were simulated once each, not once per copy.
        let exempt_bytes: u64 = self.exempt_routes.iter().map(|(bytes, _)| bytes).sum();
        let once = (b - 1) * exempt_bytes;
        report.bytes_sent = (report.bytes_sent * b).saturating_sub(once);
        report.bytes_delivered = (report.bytes_delivered * b).saturating_sub(once);
        Some(report)
    }

    /// Whether every copy's late flows (those of more than one packet) were released
    /// at one lag from the flows simulated for them, to within [`LAG_SPREAD`] of their
    /// median duration.
    fn lags_agree(&self, simulated: &[FlowOutcome], expanded: &[FlowOutcome]) -> bool {
        let mut lags = vec![(i128::MAX, i128::MIN); self.order as usize];
        let mut durations = Vec::new();
        for late in self.late.iter().filter(|l| !l.exempt) {
            let stand_in = simulated[self.flow_index[late.flow as usize] as usize];
            let lag =
                i128::from(expanded[late.flow as usize].start.0) - i128::from(stand_in.start.0);
            let (low, high) = &mut lags[late.copy as usize];
            *low = (*low).min(lag);
            *high = (*high).max(lag);
            durations.push(stand_in.fct().0);
        }
        if durations.is_empty() {
            return true;
        }
        let mid = durations.len() / 2;
        let median = *durations.select_nth_unstable(mid).1 as f64;
        lags.iter()
            .filter(|(low, high)| low <= high)
            .all(|(low, high)| (high - low) as f64 <= LAG_SPREAD * median)
    }
}

/// How far apart, as a share of their median duration, the late flows of one copy may be
/// released relative to the flows simulated for them. A copy whose late flows all lag by
/// one amount is the quotient shifted in time; lags that differ within a copy put its
/// flows' contention out of step with the quotient's. On the step of
/// `tests/accel.rs` (a tree norm between a reduce-scatter and an all-gather over four
/// hosts of four GPUs) the host shift's lags agree to within 1% of the all-gather flows'
/// duration (errors 0.011% mean, 0.14% p99), while the GPU shift's spread over 240% (the
/// norm comes down each host's chain one GPU after another; 1.3% and 6.6%).
pub(super) const LAG_SPREAD: f64 = 0.05;

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::flows::{collective_flows, FlowAlgorithm};
    use crate::topology::{NodeKind, RailOptimizedSpec};
    use crate::CollectiveKind;
    use orrery_units::{Bytes, NodeId, Picos};

    #[test]
    fn host_then_gpu_shifts_fold_a_ring_onto_one_gpu() {
        let spec = RailOptimizedSpec {
            gpus_per_host: 4,
            ..RailOptimizedSpec::dgx_h100(4)
        };
        let graph = NetGraph::rail_optimized(&spec).unwrap();
        let mut flows = FlowSet::default();
        collective_flows(
            &mut flows,
            "ring",
            CollectiveKind::AllReduce,
            FlowAlgorithm::Ring { channels: 4 },
            &(0..16).collect::<Vec<u32>>(),
            Bytes(1 << 20),
            4,
            Picos::ZERO,
        )
        .unwrap();
        let routes = Routes::compute(&graph, &flows).unwrap();
        let q = find(&graph, &flows, &routes, &vec![1; graph.num_nodes()], &[], 0).unwrap();
        assert_eq!(q.order, 4);
        assert_eq!(q.reps.len() * 4, flows.flows.len());
        // Every simulated flow is sent from the first host, and its dependencies come
        // before it.
        for (k, &r) in q.reps.iter().enumerate() {
            assert!(flows.flows[r as usize].src < 4);
            assert!(q.flows.flows[k].deps.iter().all(|d| d.index() < k));
        }
        for kind in [NodeKind::NvSwitch, NodeKind::Leaf, NodeKind::Spine] {
            let copies: Vec<u64> = graph
                .nodes_of_kind(kind)
                .iter()
                .map(|n: &NodeId| q.copies[n.index()])
                .collect();
            let want = if kind == NodeKind::NvSwitch { 1 } else { 4 };
            assert!(copies.iter().all(|&c| c == want), "{kind:?}: {copies:?}");
        }
        // Routes of the quotient use the first host's links for host links.
        for (k, &r) in q.reps.iter().enumerate() {
            let (fwd, _) = q.routes.of(k);
            let first = graph.link(LinkId(fwd[0]));
            assert_eq!(
                first.from,
                graph
                    .endpoint(flows.flows[r as usize].src as usize)
                    .unwrap()
            );
        }
    }

    /// The label filter may claim an absent label, never deny a present one, and claims
    /// few: the search's early rejections rest on the first, its speed on the second.
    #[test]
    fn labelled_pairs_sort_as_a_comparison_sort_does() {
        // Spread labels with repeats, labels all in the lowest bucket, labels all in the
        // highest; below and above the size where buckets start; every fifth left out.
        for n in [0usize, 5, 4095, 4096, 20_000] {
            for kind in 0..3 {
                let labels: Vec<u64> = (0..n as u64)
                    .map(|i| match kind {
                        0 => mix(i / 3),
                        1 => i % 97,
                        _ => u64::MAX - i % 1000,
                    })
                    .collect();
                let keep = |i: usize| !i.is_multiple_of(5);
                let mut want: Vec<(u64, u32)> = (labels.iter().enumerate())
                    .filter(|&(i, _)| keep(i))
                    .map(|(i, &l)| (l, i as u32))
                    .collect();
                want.sort_unstable();
                let got = sort_labelled(&labels, keep);
                assert_eq!(got, want, "{n} labels of kind {kind}");
            }
        }
    }

    #[test]
    fn the_label_filter_denies_only_absent_labels() {
        let mut filter = LabelFilter::new(10_000);
        let present: Vec<u64> = (0..10_000u64).map(|i| hash_label([i, 1])).collect();
        for &l in &present {
            filter.insert(l);
        }
        assert!(present.iter().all(|&l| filter.may_contain(l)));
        let claimed = (0..100_000u64)
            .filter(|&i| filter.may_contain(hash_label([i, 2])))
            .count();
        // Two bits of 16 per label: about 1.4% of absent labels pass.
        assert!(
            claimed < 3_000,
            "{claimed} of 100,000 absent labels claimed"
        );
        assert!(!LabelFilter::new(0).may_contain(hash_label([5])));
    }

    proptest::proptest! {
        /// The quotient's order skips the topological sort when every orbit waits only for
        /// orbits of lower positions; on random dependency graphs and groupings (forward
        /// or not, cyclic or not) it must be the sort's own answer.
        #[test]
        fn a_forward_quotient_keeps_the_representatives_order(
            raw in proptest::collection::vec(
                (proptest::collection::vec(0usize..64, 0..4), 0usize..64, 0usize..64),
                1..40,
            ),
            grouped in proptest::bool::ANY,
        ) {
            let n = raw.len();
            let flows = FlowSet {
                flows: raw
                    .iter()
                    .enumerate()
                    .map(|(i, (deps, _, _))| FlowSpec {
                        src: 0,
                        dst: 1,
                        bytes: Bytes(1),
                        deps: deps.iter().filter(|_| i > 0).map(|&d| FlowId((d % i.max(1)) as u32)).collect(),
                        delay: Picos(0),
                        collective: 0,
                    })
                    .collect(),
                collectives: Vec::new(),
            };
            // Without grouping every flow is its own orbit (all forward); with it, flows
            // share a group by their drawn number and the group's representative is the
            // member with the highest drawn key, so dependencies can point either way.
            let flow_rep: Vec<u32> = (0..n)
                .map(|i| {
                    if !grouped {
                        return i as u32;
                    }
                    let group = |j: usize| raw[j].1 % 8;
                    (0..n)
                        .filter(|&j| group(j) == group(i))
                        .max_by_key(|&j| (raw[j].2, j))
                        .unwrap() as u32
                })
                .collect();
            let reps: Vec<u32> = (0..n as u32).filter(|&f| flow_rep[f as usize] == f).collect();
            let position = |f: u32| reps.iter().position(|&r| r == f).unwrap();
            let deps = |k: usize| {
                flows.flows[reps[k] as usize]
                    .deps
                    .iter()
                    .map(|d| position(flow_rep[d.index()]))
                    .collect()
            };
            let sorted = dependency_order(reps.len(), deps, false)
                .map(|o| o.into_iter().map(|k| reps[k]).collect::<Vec<u32>>());
            proptest::prop_assert_eq!(quotient_order(&flows, &flow_rep, &reps), sorted);
        }
    }

    #[test]
    fn flows_of_one_packet_are_exempt_only_when_they_are_few() {
        let mut flows = FlowSet::default();
        collective_flows(
            &mut flows,
            "ring",
            CollectiveKind::AllReduce,
            FlowAlgorithm::Ring { channels: 1 },
            &(0..4).collect::<Vec<u32>>(),
            Bytes(2_000_000),
            4,
            Picos::ZERO,
        )
        .unwrap();
        let tiny = |src, dst| FlowSpec {
            src,
            dst,
            bytes: Bytes(2),
            deps: Default::default(),
            delay: Picos::ZERO,
            collective: 0,
        };
        // Nothing to exempt, or exempting turned off.
        assert!(exempt_flows(&flows, 1000).is_none());
        flows.flows.push(tiny(0, 3));
        assert!(exempt_flows(&flows, 0).is_none());
        // 24 flows of 500,000 B: 12,000 packets, and one more per exempt flow: room for
        // 121 of them.
        let exempt = exempt_flows(&flows, 1000).unwrap();
        assert_eq!(exempt.iter().filter(|&&e| e).count(), 1);
        assert!(exempt[24] && !exempt[0]);
        while flows.flows.len() < 24 + 121 {
            flows.flows.push(tiny(1, 2));
        }
        assert!(exempt_flows(&flows, 1000).is_some());
        flows.flows.push(tiny(1, 2));
        assert!(exempt_flows(&flows, 1000).is_none());
    }
}
