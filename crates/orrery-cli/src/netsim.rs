//! `orrery netsim SCENARIO`: run a network scenario and report flow completion times,
//! per-collective completion, link utilisation and PFC pauses.

use crate::{atomic_write, atomic_write_with, bad, InputProblems};
use anyhow::Result;
use orrery_net::flow_model::FlowLevelSimulator;
use orrery_net::packet::{FastForwardHeld, HeldBy, PacketConfig, TraceRequest};
use orrery_net::scenario::{build, parse_scenario, Scenario, ScenarioSpec, SimModel};
use orrery_net::sim::{FlowSimulator, SimProgress, SimReport};
use orrery_units::Picos;
use serde::Serialize;
use std::fmt::Write as _;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct NetsimArgs {
    /// The scenario TOML file.
    scenario: PathBuf,
    /// Override the scenario's simulator model.
    #[arg(long, value_parser = ["packet", "flow", "fluid"])]
    model: Option<String>,
    /// Print the result as JSON.
    #[arg(long)]
    json: bool,
    /// Also write the full report as JSON to this file: every flow with its endpoints,
    /// size, collective, dependencies, start, finish and (packet model) events.
    #[arg(long, value_name = "FILE.json")]
    out: Option<PathBuf>,
    /// Also write the run as a Perfetto / Chrome trace to this file (open it at
    /// ui.perfetto.dev): a process per host with a track per sending GPU (flows in flight
    /// at once on separate lanes), each flow from its release to its finish, and the
    /// collectives' spans.
    #[arg(long, value_name = "FILE.json")]
    trace: Option<PathBuf>,
    /// Packet model: sample the egress queue depth of this directed link (see the busiest
    /// links table for ids) and write it as CSV to --queue-trace-out.
    #[arg(long, value_name = "LINK")]
    queue_trace: Option<u32>,
    /// Where the queue-depth trace goes.
    #[arg(long, value_name = "FILE.csv", default_value = "queue-trace.csv")]
    queue_trace_out: PathBuf,
    /// Sampling period of the queue-depth trace, microseconds.
    #[arg(long, default_value_t = 1.0)]
    queue_trace_us: f64,
    /// Fluid model: step every flow in flight, freezing none of the calm ones (the
    /// reference for the calm skip, which is on by default).
    #[arg(long)]
    fluid_every_step: bool,
    /// Fluid model: the time step in nanoseconds (default 500), never longer than the
    /// shortest delay of a link the flows use. Longer steps are faster and round each
    /// rate change, pause and queue to the step.
    #[arg(long, value_name = "NS")]
    fluid_step_ns: Option<f64>,
    /// Fluid model: let links whose delay spans several steps transmit once every few of
    /// them, each at the longest multiple of the step that divides its delay and is at
    /// most this many nanoseconds; 0: every link every step. By default 1000 (1 us
    /// cables where NVLink holds the step to 200 ns) where a link shorter than the step
    /// asked for holds the step below it, 0 otherwise. Faster where flows cross both; a
    /// flow whose links' strides differ is never frozen.
    #[arg(long, value_name = "NS")]
    fluid_link_step_ns: Option<f64>,
    /// Fluid model: step every copy of traffic that repeats itself host by host (or GPU by
    /// GPU) instead of one per orbit (symmetry reduction, on by default).
    #[arg(long)]
    fluid_no_symmetry: bool,
    /// Fluid model: take every step between strided links' transmissions too, where
    /// nothing happens (skipped by default; the reference for that skip).
    #[arg(long)]
    fluid_no_gap_skip: bool,
    #[command(flatten)]
    packet: crate::packet_flags::PacketFlags,
}

/// A distribution summary.
#[derive(Debug, Clone, Serialize)]
pub struct Distribution {
    pub count: usize,
    pub min: Picos,
    pub p50: Picos,
    pub p90: Picos,
    pub p99: Picos,
    pub max: Picos,
    pub mean: Picos,
}

fn distribution(mut v: Vec<Picos>) -> Option<Distribution> {
    if v.is_empty() {
        return None;
    }
    v.sort_unstable();
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    let sum: u128 = v.iter().map(|p| u128::from(p.0)).sum();
    Some(Distribution {
        count: v.len(),
        min: v[0],
        p50: at(0.5),
        p90: at(0.9),
        p99: at(0.99),
        max: v[v.len() - 1],
        mean: Picos((sum / v.len() as u128) as u64),
    })
}

/// One collective's completion.
#[derive(Debug, Clone, Serialize)]
pub struct CollectiveSummary {
    pub name: String,
    pub flows: usize,
    pub start: Picos,
    pub finish: Picos,
    /// Packet model: the collective's flows whose packets were simulated (the others were
    /// memo hits, mirrors that held or virtual flows of a periodic collective).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub simulated_flows: Option<usize>,
    /// Packet model: the events that were its flows' own (packet arrivals and timers).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub events: Option<u64>,
}

/// Packet model: who the processed events belonged to.
#[derive(Debug, Clone, Serialize)]
pub struct EventOwners {
    /// Arrivals and timers of the collectives' flows.
    pub collectives: u64,
    /// Arrivals and timers of point-to-point flows (pipeline sends, scenario flows).
    pub point_to_point: u64,
    /// The rest: flow releases, port events (transmission ends, PFC frames, wake-ups),
    /// which belong to links, and the replays of rolled-back memo hits.
    pub other: u64,
}

/// One link's load.
#[derive(Debug, Clone, Serialize)]
pub struct LinkSummary {
    pub link: u32,
    pub from: u32,
    pub to: u32,
    pub bytes: u64,
    pub utilisation: f64,
    pub pfc_pauses: u64,
}

/// What `orrery netsim` reports.
#[derive(Debug, Clone, Serialize)]
pub struct NetsimSummary {
    pub scenario: String,
    pub model: String,
    pub end: Picos,
    pub fct: Option<Distribution>,
    pub collectives: Vec<CollectiveSummary>,
    /// Packet model: who the processed events belonged to.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub event_owners: Option<EventOwners>,
    /// The busiest links (by bytes carried), at most 10.
    pub busiest_links: Vec<LinkSummary>,
    pub pfc_pauses: u64,
    pub drops: u64,
    pub bytes_sent: u64,
    pub bytes_delivered: u64,
    pub events: u64,
    /// Wall-clock seconds the simulation took on this machine (not deterministic).
    pub wall_seconds: f64,
    /// Packet model only: ECN marks, CNPs, retransmissions, fast-forward jumps and the
    /// events they skipped.
    pub packet_stats: Option<orrery_net::packet::PacketStats>,
    /// Fluid model only: what freezing calm flows did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub calm_skip: Option<orrery_net::packet::CalmSkipStats>,
    /// Fluid model only: the time step it took, in picoseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fluid_step_ps: Option<u64>,
    /// Fluid model only, where some link the flows use transmitted once every few steps:
    /// the longest such link step, in picoseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fluid_link_step_ps: Option<u64>,
    /// Packet and fluid models: the rotations symmetry reduction found, outermost first.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub symmetry: Vec<orrery_net::packet::SymmetryShift>,
    /// Fluid model only, where symmetry reduction found a rotation: the flows stepped.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fluid_simulated_flows: Option<u64>,
    /// Fluid model only, where some link was strided: the steps skipped between strided
    /// links' transmissions, where nothing happened.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fluid_gap_skipped_steps: Option<u64>,
}

/// One flow of the `--out` report: what it was (the flow set's spec, its collective by
/// name so a reader need not cross-reference) and what became of it. Fields in
/// alphabetical order, as the report's other keys are.
#[derive(Debug, Serialize)]
struct FlowRecord<'a> {
    bytes: u64,
    collective: &'a str,
    /// Flows (indices into `flows`) whose finish releases this one.
    deps: &'a [orrery_units::FlowId],
    dst: u32,
    /// Packet model: its packets' arrivals and its timers (zero when acceleration
    /// stood in for every packet).
    #[serde(skip_serializing_if = "Option::is_none")]
    events: Option<u64>,
    finish: Picos,
    src: u32,
    start: Picos,
}

/// The flows of the `--out` report, serialised one by one as the writer takes them: at
/// 8,192 GPUs a step has millions of flows, and the report built in memory first (as a
/// JSON tree, then as text) peaked at 18.9 GB.
struct FlowRecords<'a> {
    scenario: &'a Scenario,
    report: &'a SimReport,
    events: Option<&'a [u64]>,
}

impl Serialize for FlowRecords<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let set = &self.scenario.flows;
        serializer.collect_seq(set.flows.iter().zip(&self.report.flows).enumerate().map(
            |(i, (f, o))| {
                FlowRecord {
                    bytes: f.bytes.0,
                    collective: set
                        .collectives
                        .get(f.collective as usize)
                        .map_or("", |c| c.name.as_str()),
                    deps: &f.deps,
                    dst: f.dst,
                    events: self.events.and_then(|e| e.get(i)).copied(),
                    finish: o.finish,
                    src: f.src,
                    start: o.start,
                }
            },
        ))
    }
}

/// What `--out` writes: the simulator's report, every field of it, with `flows` replaced
/// by the flows described ([`FlowRecord`]) and the scenario's name added, so a flow's
/// timing can be read without rebuilding the scenario's flow set. Keys in alphabetical
/// order (the order of the JSON tree this report was first built as).
#[derive(Serialize)]
struct FullReport<'a> {
    accel: serde_json::Value,
    bytes_delivered: u64,
    bytes_sent: u64,
    drops: u64,
    end: Picos,
    events: u64,
    flows: FlowRecords<'a>,
    link_bytes: &'a [u64],
    model: &'a str,
    pfc_pauses: &'a [u64],
    scenario: &'a str,
}

fn full_report<'a>(
    s: &'a Scenario,
    r: &'a SimReport,
    flow_events: Option<&'a [u64]>,
) -> serde_json::Result<FullReport<'a>> {
    Ok(FullReport {
        // A handful of counters: as a tree, so their keys come out sorted too.
        accel: serde_json::to_value(r.accel)?,
        bytes_delivered: r.bytes_delivered,
        bytes_sent: r.bytes_sent,
        drops: r.drops,
        end: r.end,
        events: r.events,
        flows: FlowRecords {
            scenario: s,
            report: r,
            events: flow_events,
        },
        link_bytes: &r.link_bytes,
        model: &r.model,
        pfc_pauses: &r.pfc_pauses,
        scenario: &s.name,
    })
}

/// The report of run `r` of scenario `s`; `flow_events` is the packet model's per-flow
/// attribution of the events ([`orrery_net::packet::PacketRun::flow_events`]).
fn summarize(s: &Scenario, r: &SimReport, flow_events: Option<&[u64]>, wall: f64) -> NetsimSummary {
    let fct = distribution(r.flows.iter().map(|f| f.fct()).collect());
    let spans = orrery_net::sim::collective_spans(&s.flows, &r.flows);
    let mut collectives: Vec<CollectiveSummary> = s
        .flows
        .collectives
        .iter()
        .zip(&spans)
        .map(|(c, span)| CollectiveSummary {
            name: c.name.clone(),
            flows: span.flows,
            start: span.start,
            finish: span.finish,
            simulated_flows: flow_events.map(|_| 0),
            events: flow_events.map(|_| 0),
        })
        .collect();
    if let Some(events) = flow_events {
        for (f, &own) in s.flows.flows.iter().zip(events) {
            if let Some(c) = collectives.get_mut(f.collective as usize) {
                if let (Some(sim), Some(ev)) = (&mut c.simulated_flows, &mut c.events) {
                    *sim += usize::from(own > 0);
                    *ev += own;
                }
            }
        }
    }
    // Point-to-point flows are their own one-flow "collectives"; the FCT distribution
    // already covers them.
    let is_collective: Vec<bool> = s
        .flows
        .collectives
        .iter()
        .map(|c| c.kind.is_some())
        .collect();
    let event_owners = flow_events.map(|per_flow| {
        let mut owners = EventOwners {
            collectives: 0,
            point_to_point: 0,
            other: 0,
        };
        for (f, &n) in s.flows.flows.iter().zip(per_flow) {
            if is_collective
                .get(f.collective as usize)
                .copied()
                .unwrap_or(false)
            {
                owners.collectives += n;
            } else {
                owners.point_to_point += n;
            }
        }
        owners.other = r
            .events
            .saturating_sub(owners.collectives + owners.point_to_point);
        owners
    });
    let mut index = 0;
    collectives.retain(|c| {
        let keep = c.flows > 0 && is_collective[index];
        index += 1;
        keep
    });
    let end_s = r.end.as_secs_f64().max(f64::MIN_POSITIVE);
    let mut links: Vec<LinkSummary> = s
        .graph
        .links()
        .iter()
        .enumerate()
        .map(|(i, l)| {
            let bytes = r.link_bytes.get(i).copied().unwrap_or(0);
            LinkSummary {
                link: i as u32,
                from: l.from.0,
                to: l.to.0,
                bytes,
                utilisation: bytes as f64 / (l.bandwidth.0 * end_s),
                pfc_pauses: r.pfc_pauses.get(i).copied().unwrap_or(0),
            }
        })
        .filter(|l| l.bytes > 0 || l.pfc_pauses > 0)
        .collect();
    links.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.link.cmp(&b.link)));
    links.truncate(10);
    NetsimSummary {
        scenario: s.name.clone(),
        model: r.model.clone(),
        end: r.end,
        fct,
        collectives,
        event_owners,
        busiest_links: links,
        pfc_pauses: r.pfc_pauses.iter().sum(),
        drops: r.drops,
        bytes_sent: r.bytes_sent,
        bytes_delivered: r.bytes_delivered,
        events: r.events,
        wall_seconds: wall,
        packet_stats: None,
        calm_skip: None,
        fluid_step_ps: None,
        fluid_link_step_ps: None,
        symmetry: Vec::new(),
        fluid_simulated_flows: None,
        fluid_gap_skipped_steps: None,
    }
}

/// Where the packet model's events went: by owner, then the collectives that cost the most.
fn render_event_owners(s: &NetsimSummary, o: &EventOwners) -> String {
    let mut out = String::new();
    let share = |n: u64| 100.0 * n as f64 / (s.events.max(1) as f64);
    let _ = writeln!(
        out,
        "\nWhere the events went: collectives' flows {} ({:.1}%), point-to-point flows {} ({:.1}%), releases, ports and replays {} ({:.1}%)",
        o.collectives,
        share(o.collectives),
        o.point_to_point,
        share(o.point_to_point),
        o.other,
        share(o.other)
    );
    let mut costly: Vec<&CollectiveSummary> = s
        .collectives
        .iter()
        .filter(|c| c.events.unwrap_or(0) > 0)
        .collect();
    // Most events first; ties (and the order of equals) by the collectives' own order.
    costly.sort_by_key(|c| std::cmp::Reverse(c.events.unwrap_or(0)));
    const SHOWN: usize = 10;
    for c in costly.iter().take(SHOWN) {
        let _ = writeln!(
            out,
            "  {:<28} {:>12} events ({:5.1}%)  {:>6} of {:>6} flows simulated",
            c.name,
            c.events.unwrap_or(0),
            share(c.events.unwrap_or(0)),
            c.simulated_flows.unwrap_or(0),
            c.flows
        );
    }
    if costly.len() > SHOWN {
        let _ = writeln!(
            out,
            "  ... {} more collectives with simulated flows (all in --json)",
            costly.len() - SHOWN
        );
    }
    out
}

/// Where the partitions' flow-samples went ([`FastForwardHeld`]), the largest share
/// first; `None` when none was counted (no partitioned fast-forwarding).
fn render_held(held: &FastForwardHeld) -> Option<String> {
    let total = held.total();
    if total == 0 {
        return None;
    }
    let mut counts: Vec<(HeldBy, u64)> = held.counts().filter(|&(_, n)| n > 0).collect();
    // Largest first; equal counts keep the order of the tests.
    counts.sort_by_key(|&(_, n)| std::cmp::Reverse(n));
    let shares: Vec<String> = counts
        .iter()
        .map(|&(by, n)| format!("{} {:.1}%", by.name(), 100.0 * n as f64 / total as f64))
        .collect();
    Some(format!(
        "  partitions' flow-samples by the test that held them ({total}): {}\n",
        shares.join(", ")
    ))
}

fn render(s: &NetsimSummary) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "orrery netsim: {} ({} model)", s.scenario, s.model);
    let _ = writeln!(
        out,
        "simulated time {}, {} events in {:.2} s wall ({:.2} M events/s)\n",
        s.end,
        s.events,
        s.wall_seconds,
        s.events as f64 / s.wall_seconds.max(1e-9) / 1e6
    );
    if let Some(d) = &s.fct {
        let _ = writeln!(out, "Flow completion times ({} flows)", d.count);
        let _ = writeln!(
            out,
            "  min {}  p50 {}  p90 {}  p99 {}  max {}  mean {}\n",
            d.min, d.p50, d.p90, d.p99, d.max, d.mean
        );
    }
    if !s.collectives.is_empty() {
        let _ = writeln!(out, "Collectives");
        const SHOWN: usize = 20;
        for c in s.collectives.iter().take(SHOWN) {
            let _ = writeln!(
                out,
                "  {:<28} {:>6} flows  done at {}  (took {})",
                c.name,
                c.flows,
                c.finish,
                c.finish - c.start
            );
        }
        if s.collectives.len() > SHOWN {
            let last = s
                .collectives
                .iter()
                .map(|c| c.finish)
                .max()
                .unwrap_or(Picos::ZERO);
            let _ = writeln!(
                out,
                "  ... {} more (all in --json); the last finishes at {last}",
                s.collectives.len() - SHOWN
            );
        }
        out.push('\n');
    }
    let _ = writeln!(out, "Busiest links");
    for l in &s.busiest_links {
        let _ = writeln!(
            out,
            "  link {:>5} ({:>5} -> {:>5})  {:>14} B  {:5.1}% busy  {} PFC pauses",
            l.link,
            l.from,
            l.to,
            l.bytes,
            100.0 * l.utilisation,
            l.pfc_pauses
        );
    }
    let _ = writeln!(
        out,
        "\nPFC pauses {}, drops {}, bytes sent {}, delivered {}",
        s.pfc_pauses, s.drops, s.bytes_sent, s.bytes_delivered
    );
    if let Some(step) = s.fluid_step_ps {
        let links = s
            .fluid_link_step_ps
            .map(|l| format!(" (links with longer delays every {} at most)", Picos(l)))
            .unwrap_or_default();
        let _ = writeln!(out, "fluid step {}{links}", Picos(step));
    }
    if let Some(gaps) = s.fluid_gap_skipped_steps {
        let _ = writeln!(
            out,
            "steps between strided links' transmissions skipped: {gaps}"
        );
    }
    if let Some(c) = &s.calm_skip {
        let _ = writeln!(
            out,
            "calm skip: {} flows frozen ({} thawed early by traffic reaching their links), {} steps skipped",
            c.freezes, c.forced_thaws, c.skipped_steps
        );
    }
    if let Some(stepped) = s.fluid_simulated_flows {
        let copies: u64 = s.symmetry.iter().map(|r| u64::from(r.copies())).product();
        let _ = writeln!(
            out,
            "symmetry: {stepped} flows stepped, each for {copies} copies"
        );
        for shift in &s.symmetry {
            let _ = writeln!(out, "symmetry: {shift}");
        }
    }
    if let Some(p) = &s.packet_stats {
        let _ = writeln!(
            out,
            "ECN marks {}, CNPs {}, go-back-N rewinds {}, timeouts {}, peak switch buffer {} B",
            p.ecn_marks, p.cnps, p.go_backs, p.timeouts, p.peak_switch_bytes
        );
        let _ = writeln!(
            out,
            "fast-forward: {} jumps ({} holding a recovering flow, {} of quiet partitions, {} through DCQCN's cuts, {} packets carried into growing queues, {} out of draining ones) over {} of simulated time, ~{} events skipped",
            p.fast_forwards, p.recovering_jumps, p.quiet_jumps, p.cut_jumps, p.carried_packets, p.drained_packets, p.jumped_time, p.skipped_events
        );
        if let Some(line) = render_held(&p.ff_held) {
            out.push_str(&line);
        }
        let _ = writeln!(
            out,
            "memo: {} lookups, {} hits ({:.1}%), {} recorded, {} aborted ({} events replayed), {} mirrored ({} broken), ~{} events skipped",
            p.memo_lookups,
            p.memo_hits,
            100.0 * p.memo_hit_rate(),
            p.memo_recorded,
            p.memo_aborts,
            p.memo_replayed_events,
            p.memo_mirrored,
            p.memo_mirror_breaks,
            p.memo_skipped_events
        );
        let _ = writeln!(
            out,
            "periodic: {} collectives extrapolated ({} ended by an intruder, meeting {} flows in progress), {} flows virtual, ~{} events skipped",
            p.periodic_starts,
            p.periodic_aborts,
            p.periodic_met,
            p.periodic_flows,
            p.periodic_skipped_events
        );
        let _ = writeln!(
            out,
            "collective memo: {} collectives kept, {} repeated ({} ended early, meeting {} flows in progress), {} flows finished at kept times, ~{} events skipped",
            p.collective_memo_records,
            p.collective_memo_repeats,
            p.collective_memo_aborts,
            p.collective_memo_met,
            p.collective_memo_flows,
            p.collective_memo_skipped_events
        );
        if p.symmetry_order > 1 {
            let _ = writeln!(
                out,
                "symmetry: {} flows simulated, each for {} copies, ~{} events skipped",
                p.symmetry_flows, p.symmetry_order, p.symmetry_skipped_events
            );
            for shift in &s.symmetry {
                let _ = writeln!(out, "symmetry: {shift}");
            }
            if p.symmetry_exempt_flows > 0 {
                let _ = writeln!(
                    out,
                    "symmetry: {} one-packet flows exempt from the check, {} flows waiting for them timed through their dependencies",
                    p.symmetry_exempt_flows, p.symmetry_late_flows
                );
            }
            if p.symmetry_retried_events > 0 {
                let _ = writeln!(
                    out,
                    "symmetry: a quotient whose late flows came out of step with their copies was set aside ({} events, counted above)",
                    p.symmetry_retried_events
                );
            }
        } else {
            out.push_str("symmetry: none found\n");
        }
        let _ = writeln!(
            out,
            "events processed {}, ~{} skipped in all",
            s.events,
            p.total_skipped_events()
        );
    }
    if let Some(o) = &s.event_owners {
        out.push_str(&render_event_owners(s, o));
    }
    out
}

const GIB: f64 = (1u64 << 30) as f64;

/// The `[job]` table of a scenario: a job (preset or file, with overrides) whose training
/// step's communication is the traffic.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct JobTraffic {
    preset: Option<String>,
    /// A job TOML file, relative to the scenario file.
    file: Option<PathBuf>,
    #[serde(default)]
    set: Vec<String>,
    /// Which communication to include: any of tp, cp, ep, dp, pp (default all).
    traffic: Option<Vec<String>>,
    /// When flows are released: `rendezvous` (the default), `dependencies` or `replay`
    /// ([`orrery_predict::traffic::Release`]).
    release: Option<String>,
    /// The memory the step's flows may take, in GiB (default 4,
    /// [`orrery_predict::traffic::DEFAULT_MAX_TRAFFIC_BYTES`]).
    max_traffic_gib: Option<f64>,
}

/// The job a scenario's `[job]` table names (`preset` or `file`, with `set`), or what is
/// wrong with it.
fn job_of(
    j: &JobTraffic,
    scenario_path: &std::path::Path,
) -> std::result::Result<orrery_spec::Job, String> {
    let text = match (&j.preset, &j.file) {
        (Some(_), Some(_)) => return Err("[job]: give either preset or file, not both".into()),
        (Some(name), None) => orrery_spec::preset_job_text(name)
            .map_err(|e| format!("job.preset: {e}"))?
            .to_string(),
        (None, Some(file)) => {
            let path = scenario_path
                .parent()
                .unwrap_or(std::path::Path::new("."))
                .join(file);
            std::fs::read_to_string(&path)
                .map_err(|e| format!("job.file: cannot read {}: {e}", path.display()))?
        }
        (None, None) => return Err("[job]: needs preset or file".into()),
    };
    let job_spec = orrery_spec::load_job_spec(&text, &j.set).map_err(|e| e.to_string())?;
    orrery_spec::Job::from_spec(&job_spec).map_err(|e| e.to_string())
}

fn job_scenario(
    table: &toml::Table,
    spec: &ScenarioSpec,
    scenario_path: &std::path::Path,
) -> Result<Scenario> {
    let j: JobTraffic = toml::Value::Table(table.clone())
        .try_into()
        .map_err(|e| bad(format!("[job]: {e}")))?;
    // Every problem of the job and of the table's own fields at once.
    let job = job_of(&j, scenario_path);
    let mut problems = Vec::new();
    let select = match &j.traffic {
        None => Some(orrery_predict::traffic::TrafficSelection::ALL),
        Some(names) => orrery_predict::traffic::TrafficSelection::from_names(names)
            .map_err(|unknown| {
                problems.push(format!(
                    "job.traffic: unknown kinds {unknown:?}; known: tp, cp, ep, dp, pp"
                ))
            })
            .ok(),
    };
    let release = match j.release.as_deref() {
        None => Some(orrery_predict::traffic::Release::default()),
        Some(name) => {
            let found = orrery_predict::traffic::Release::from_name(name);
            if found.is_none() {
                let known: Vec<&str> = orrery_predict::traffic::Release::ALL
                    .iter()
                    .map(|r| r.name())
                    .collect();
                problems.push(format!(
                    "job.release: unknown rule {name:?}; known: {}",
                    known.join(", ")
                ));
            }
            found
        }
    };
    let max_bytes = match j.max_traffic_gib {
        None => orrery_predict::traffic::DEFAULT_MAX_TRAFFIC_BYTES,
        Some(gib) if gib.is_finite() && gib > 0.0 && gib * GIB < u64::MAX as f64 => {
            (gib * GIB) as u64
        }
        Some(gib) => {
            problems.push(format!(
                "job.max_traffic_gib: must be a positive number of GiB, got {gib}"
            ));
            0
        }
    };
    let (Ok(job), Some(select), Some(release), true) =
        (job.as_ref(), select, release, problems.is_empty())
    else {
        let mut out: Vec<String> = job.err().into_iter().collect();
        if !problems.is_empty() {
            out.push(format!(
                "the [job] table has problems:\n  {}",
                problems.join("\n  ")
            ));
        }
        return Err(bad(out.join("\n")));
    };
    let (graph, flows) = orrery_predict::traffic::job_traffic_limited(
        job, select, release, max_bytes,
    )
    .map_err(|e| match e {
        orrery_predict::traffic::TrafficError::TooLarge { .. } => bad(format!(
            "[job]: {e} (job.traffic, now {}; job.max_traffic_gib, now {})",
            j.traffic
                .as_ref()
                .map_or("every kind".to_string(), |t| t.join(", ")),
            j.max_traffic_gib
                .unwrap_or(orrery_predict::traffic::DEFAULT_MAX_TRAFFIC_BYTES as f64 / GIB)
        )),
        other => other.into(),
    })?;
    let name = spec
        .name
        .clone()
        .unwrap_or_else(|| format!("training step of {}", job.name()));
    Ok(Scenario::from_parts(&name, graph, flows, spec))
}

/// A scenario's `[packet]` table as a packet-model configuration (the defaults where the
/// table is absent), or every problem of it, each naming its field.
fn packet_config(table: Option<&toml::Table>) -> Result<PacketConfig> {
    let Some(table) = table else {
        return Ok(PacketConfig::default());
    };
    let config: PacketConfig = toml::Value::Table(table.clone())
        .try_into()
        .map_err(|e| bad(format!("packet: {e}")))?;
    let problems = config.problems();
    if problems.is_empty() {
        return Ok(config);
    }
    let list: Vec<String> = problems
        .iter()
        .map(|p| format!("packet.{}: {}", p.field, p.reason))
        .collect();
    Err(bad(format!(
        "the [packet] table has problems:\n  {}",
        list.join("\n  ")
    )))
}

/// A time given on the command line in nanoseconds (`flag` names it in the error): at
/// least a picosecond.
pub(crate) fn nanoseconds(flag: &str, ns: f64) -> Result<Picos, String> {
    if ns.is_finite() && ns >= 0.001 {
        Ok(Picos::from_secs_f64(ns * 1e-9))
    } else {
        Err(format!(
            "{flag} must be a number of nanoseconds, at least 0.001 (1 ps)"
        ))
    }
}

/// The fluid model's longest link step from `ns` nanoseconds: 0 (every link every step)
/// or a time as [`nanoseconds`] takes it.
pub(crate) fn link_step(flag: &str, ns: f64) -> Result<Picos, String> {
    if ns == 0.0 {
        return Ok(Picos::ZERO);
    }
    nanoseconds(flag, ns).map_err(|_| {
        format!("{flag} must be 0 (every link every step) or a number of nanoseconds, at least 0.001 (1 ps)")
    })
}

pub fn run_netsim(args: &NetsimArgs) -> Result<()> {
    let text = std::fs::read_to_string(&args.scenario).map_err(|e| {
        bad(format!(
            "cannot read scenario {}: {e}",
            args.scenario.display()
        ))
    })?;
    let spec = parse_scenario(&text).map_err(|e| bad(e.to_string()))?;
    // The file's problems (its traffic's, its [packet] table's) and the flags' at once.
    let mut problems = InputProblems::default();
    problems.output("--out", args.out.as_deref());
    problems.output("--trace", args.trace.as_deref());
    if args.queue_trace.is_some() {
        problems.output("--queue-trace-out", Some(&args.queue_trace_out));
    }
    args.packet.check_outputs(&mut problems);
    let scenario = problems.check(match &spec.job {
        Some(job) => job_scenario(job, &spec, &args.scenario),
        None => build(&spec).map_err(|e| bad(e.to_string())),
    });
    let packet_config = problems.check(packet_config(spec.packet.as_ref()));
    let model = match args.model.as_deref() {
        Some("flow") => SimModel::Flow,
        Some("fluid") => SimModel::Fluid,
        Some(_) => SimModel::Packet,
        None => spec.simulator.model_or_default(),
    };
    if model != SimModel::Packet {
        // A switch of the packet model would be ignored: refused, as predict refuses it.
        let also: &[&str] = if args.queue_trace.is_some() {
            &["--queue-trace"]
        } else {
            &[]
        };
        let why = if model == SimModel::Flow {
            "this run is at flow level"
        } else {
            "the fluid model has no packets to accelerate or trace"
        };
        if let Some(e) = args
            .packet
            .refuse_without_packet(also, why, "run it with --model packet")
        {
            problems.push(&e.to_string());
        }
    }
    for (given, flag) in [
        (args.fluid_every_step, "--fluid-every-step"),
        (args.fluid_no_symmetry, "--fluid-no-symmetry"),
        (args.fluid_no_gap_skip, "--fluid-no-gap-skip"),
    ] {
        if given && model != SimModel::Fluid {
            problems.push(&format!(
                "{flag} applies to the fluid model only: add --model fluid or leave it out"
            ));
        }
    }
    let [fluid_step, fluid_link_step] = [
        (
            "--fluid-step-ns",
            args.fluid_step_ns,
            nanoseconds as fn(&str, f64) -> _,
        ),
        ("--fluid-link-step-ns", args.fluid_link_step_ns, link_step),
    ]
    .map(|(flag, value, parse)| {
        let ns = value?;
        if model != SimModel::Fluid {
            problems.push(&format!(
                "{flag} applies to the fluid model only: add --model fluid or leave it out"
            ));
        }
        parse(flag, ns).map_err(|e| problems.push(&e)).ok()
    });
    if args.queue_trace.is_some() && !(args.queue_trace_us.is_finite() && args.queue_trace_us > 0.0)
    {
        problems.push("--queue-trace-us must be a positive number");
    }
    let (scenario, packet_config) = problems.finish(scenario.zip(packet_config))?;
    let total = scenario.flows.flows.len() as u64;
    let bar = crate::progress_bar(total, "simulating {bar:40} {pos}/{len} flows done, {msg}");
    let mut progress = |p: SimProgress| {
        bar.set_position(p.flows_done as u64);
        bar.set_message(format!("simulated {} , {} events", p.now, p.events));
    };
    let start = std::time::Instant::now();
    let mut samples = Vec::new();
    let mut stats = None;
    let mut fluid_run: Option<orrery_net::packet::FluidRun> = None;
    let mut flow_events = None;
    let mut symmetry = Vec::new();
    let report = match model {
        SimModel::Flow => FlowLevelSimulator::default().simulate_with_progress(
            &scenario.graph,
            &scenario.flows,
            &mut progress,
        ),
        // The fluid model draws nothing, so the scenario's seed does not reach it.
        SimModel::Fluid => orrery_net::packet::FluidSimulator {
            config: packet_config,
            calm_skip: !args.fluid_every_step,
            step: fluid_step.unwrap_or(orrery_net::packet::FluidSimulator::DEFAULT_STEP),
            longest_link_step: fluid_link_step,
            symmetry: !args.fluid_no_symmetry,
            gap_skip: !args.fluid_no_gap_skip,
        }
        .run_with_progress(&scenario.graph, &scenario.flows, &mut progress)
        .map(|(report, run)| {
            fluid_run = Some(run);
            report
        }),
        SimModel::Packet => {
            let mut config = packet_config;
            config.seed = scenario.seed;
            args.packet.apply(&mut config);
            let mut trace = TraceRequest {
                interval: Picos::ZERO,
                ports: Vec::new(),
                flows: false,
            };
            if let Some(link) = args.queue_trace {
                if link as usize >= scenario.graph.links().len() {
                    return Err(bad(format!(
                        "--queue-trace: link {link} does not exist (the topology has {})",
                        scenario.graph.links().len()
                    )));
                }
                trace = TraceRequest {
                    interval: Picos::from_secs_f64(args.queue_trace_us * 1e-6),
                    ports: vec![orrery_units::LinkId(link)],
                    flows: false,
                };
            }
            let sim = args.packet.simulator_with(config);
            let result = sim
                .run_with_progress(&scenario.graph, &scenario.flows, &trace, &mut progress)
                .map(|run| {
                    samples = run.samples;
                    stats = Some(run.stats);
                    flow_events = Some(run.flow_events);
                    symmetry = run.symmetry;
                    run.report
                });
            if result.is_ok() {
                args.packet.save_cache(&sim)?;
            }
            result
        }
    }
    .map_err(|e| anyhow::anyhow!("simulation failed: {e}"))?;
    let wall = start.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let mut summary = summarize(&scenario, &report, flow_events.as_deref(), wall);
    summary.packet_stats = stats;
    if let Some(run) = fluid_run {
        summary.calm_skip = Some(run.calm_skip);
        summary.fluid_step_ps = Some(run.step.0);
        summary.fluid_link_step_ps =
            (run.longest_link_step > run.step).then_some(run.longest_link_step.0);
        summary.fluid_gap_skipped_steps =
            (run.longest_link_step > run.step).then_some(run.gap_skipped_steps);
        if !run.symmetry.is_empty() {
            summary.fluid_simulated_flows = Some(run.simulated_flows);
        }
        symmetry = run.symmetry;
    }
    summary.symmetry = symmetry;
    if args.json {
        outln!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        out!("{}", render(&summary));
    }
    // At flow level --queue-trace was refused before the run.
    if let Some(link) = args.queue_trace {
        let mut csv = String::from("time_us,queue_bytes\n");
        for s in &samples {
            let _ = writeln!(
                csv,
                "{:.3},{}",
                s.time.as_micros_f64(),
                s.queue.first().copied().unwrap_or(0)
            );
        }
        atomic_write(&args.queue_trace_out, csv.as_bytes())?;
        eprintln!(
            "wrote queue-depth trace of link {link} ({} samples) to {}",
            samples.len(),
            args.queue_trace_out.display()
        );
    }
    if let Some(path) = &args.trace {
        atomic_write_with(path, |w| {
            orrery_net::flow_trace::write_flow_trace(
                &scenario.name,
                &scenario.flows,
                &report,
                scenario.graph.endpoints_per_host(),
                w,
            )
        })?;
        eprintln!(
            "wrote a Perfetto trace of {} flows to {}",
            report.flows.len(),
            path.display()
        );
    }
    if let Some(path) = &args.out {
        let full = full_report(&scenario, &report, flow_events.as_deref())?;
        atomic_write_with(path, |w| {
            serde_json::to_writer_pretty(&mut *w, &full).map_err(std::io::Error::from)
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_full_report_has_every_field_of_the_simulators_report() {
        // `--out` writes the report field by field (streamed, not built as a tree first):
        // a field added to `SimReport` must be added there too.
        let scenario = orrery_net::scenario::load_scenario(
            "name = \"pair\"\n[topology]\nkind = \"single_switch\"\nendpoints = 2\n\
             [[flows]]\nsrc = 0\ndst = 1\nbytes = 1000\n",
        )
        .unwrap();
        let report = SimReport {
            flows: vec![Default::default()],
            ..Default::default()
        };
        let keys = |v: &serde_json::Value| -> Vec<String> {
            v.as_object().unwrap().keys().cloned().collect()
        };
        let tree = serde_json::to_value(&report).unwrap();
        let full =
            serde_json::to_value(full_report(&scenario, &report, Some(&[3])).unwrap()).unwrap();
        let mut want = keys(&tree);
        want.push("scenario".to_string());
        want.sort();
        assert_eq!(keys(&full), want);
        // Written in the order a JSON tree sorts them in, as the report always was.
        let text = serde_json::to_string(&full_report(&scenario, &report, None).unwrap()).unwrap();
        let order: Vec<usize> = want
            .iter()
            .map(|k| text.find(&format!("\"{k}\"")).unwrap())
            .collect();
        assert!(order.windows(2).all(|w| w[0] < w[1]), "{text}");
        assert_eq!(full["flows"][0]["events"], 3);
        assert_eq!(full["flows"][0]["bytes"], 1000);
    }

    #[test]
    fn held_back_samples_are_listed_largest_share_first() {
        assert_eq!(render_held(&FastForwardHeld::default()), None);
        let mut held = FastForwardHeld::default();
        for (by, n) in [
            (HeldBy::Jumped, 1),
            (HeldBy::Busy, 2),
            (HeldBy::Settling, 2),
            (HeldBy::CompletionNear, 5),
        ] {
            held.add(by, n);
        }
        // Equal shares keep the order of the tests (busy before settling).
        assert_eq!(
            render_held(&held).unwrap(),
            "  partitions' flow-samples by the test that held them (10): completion near 50.0%, busy 20.0%, \
             settling 20.0%, jumped 10.0%\n"
        );
    }
}
