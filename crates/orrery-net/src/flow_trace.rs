//! A simulation's flows as a Chrome / Perfetto trace-event timeline (`orrery netsim
//! --trace`): where the network's time went, flow by flow, in a viewer that zooms.
//!
//! The file is `{"traceEvents":[...],"displayTimeUnit":"ms","otherData":{...}}`, one event per
//! line:
//!
//! - one process per host (`host H`), with a track per source endpoint and *lane*: each flow
//!   is a complete event (`"ph":"X"`) from its release to its finish on the track of the
//!   endpoint that sends it, named after its collective, with its id, destination and bytes
//!   in `args`. A viewer draws complete events that overlap on one track as if nested, so
//!   the flows an endpoint has in flight at once (its channels, a pipeline send beside a
//!   gradient bucket) go on separate lanes: each flow takes the lowest-numbered lane free at
//!   its release (`GPU 3`, `GPU 3 · 2`, ...);
//! - a last process, `collectives`, with one slice per collective from its first flow's
//!   release to its last flow's finish (laned the same way), its flows and bytes in `args`.
//!
//! `ts` and `dur` are microseconds printed with exactly six decimals from integer
//! picoseconds: the trace loses no precision and is byte-identical for identical reports.
//! It writes what the report holds and nothing else: no queue depths or pauses over time
//! (the packet model's `--queue-trace` samples those), and a flow's slice says when it ran,
//! not at what rate.

use crate::flows::FlowSet;
use crate::sim::{collective_spans, CollectiveSpan, SimReport};
use orrery_units::trace_text::{push_json_str, push_micros};
use orrery_units::Picos;
use std::fmt::Write as _;
use std::io;

/// Buffered bytes above which the trace is flushed into the writer.
const FLUSH_AT: usize = 1 << 20;

/// Writes `report`, a run of `flows` on a fabric of `endpoints_per_host` endpoints per host,
/// as a trace named `scenario`. Fails only if the writer does.
pub fn write_flow_trace(
    scenario: &str,
    flows: &FlowSet,
    report: &SimReport,
    endpoints_per_host: usize,
    w: &mut impl io::Write,
) -> io::Result<()> {
    let per_host = endpoints_per_host.max(1) as u64;
    let mut ev = Events {
        out: String::from("{\"traceEvents\":[\n"),
        first: true,
    };
    // Flows by their source, each source's in release order (ties by id).
    let mut by_source: Vec<(u32, Picos, usize)> = flows
        .flows
        .iter()
        .zip(&report.flows)
        .enumerate()
        .map(|(i, (f, o))| (f.src, o.start, i))
        .collect();
    by_source.sort_unstable();
    let mut last_host = None;
    for group in by_source.chunk_by(|a, b| a.0 == b.0) {
        let src = group[0].0;
        let host = u64::from(src) / per_host;
        if last_host != Some(host) {
            last_host = Some(host);
            ev.process(host, &format!("host {host}"));
        }
        let spans: Vec<(Picos, Picos)> = group
            .iter()
            .map(|&(_, _, i)| (report.flows[i].start, report.flows[i].finish))
            .collect();
        let lanes = lanes(&spans);
        for lane in 0..lanes.iter().max().map_or(0, |&l| l + 1) {
            let name = if lane == 0 {
                format!("GPU {src}")
            } else {
                format!("GPU {src} · {}", lane + 1)
            };
            ev.thread(host, track_id(src, lane), &name);
        }
        for (&(_, _, i), &lane) in group.iter().zip(&lanes) {
            let (f, o) = (&flows.flows[i], &report.flows[i]);
            let name = flows
                .collectives
                .get(f.collective as usize)
                .map_or("flow", |c| c.name.as_str());
            let args = format!("\"flow\":{i},\"dst\":{},\"bytes\":{}", f.dst, f.bytes.0);
            let track = (host, track_id(src, lane));
            ev.slice(name, "flow", track, (o.start, o.fct()), &args);
        }
        ev.flush_if_full(w)?;
    }
    // The collectives that have flows, in release order (ties by index).
    let mut collectives: Vec<(usize, CollectiveSpan)> = collective_spans(flows, &report.flows)
        .into_iter()
        .enumerate()
        .filter(|(_, c)| c.flows > 0)
        .collect();
    collectives.sort_by_key(|(index, c)| (c.start, *index));
    if !collectives.is_empty() {
        // After every host, whatever the hosts' numbers.
        let pid = last_host.map_or(0, |h| h + 1);
        ev.process(pid, "collectives");
        let spans: Vec<(Picos, Picos)> = collectives
            .iter()
            .map(|(_, c)| (c.start, c.finish))
            .collect();
        let lanes = lanes(&spans);
        for lane in 0..lanes.iter().max().map_or(0, |&l| l + 1) {
            ev.thread(pid, lane as u64, &format!("lane {}", lane + 1));
        }
        for (&(index, c), &lane) in collectives.iter().zip(&lanes) {
            let args = format!(
                "\"collective\":{index},\"flows\":{},\"bytes\":{}",
                c.flows, c.bytes
            );
            let span = (c.start, Picos(c.finish.0.saturating_sub(c.start.0)));
            let name = &flows.collectives[index].name;
            ev.slice(name, "collective", (pid, lane as u64), span, &args);
            ev.flush_if_full(w)?;
        }
    }
    let out = &mut ev.out;
    out.push_str("\n],\"displayTimeUnit\":\"ms\",\"otherData\":{\"scenario\":");
    push_json_str(out, scenario);
    out.push_str(",\"model\":");
    push_json_str(out, &report.model);
    out.push_str(",\"end_us\":");
    push_micros(out, report.end);
    let _ = writeln!(out, ",\"flows\":{}}}}}", report.flows.len());
    w.write_all(out.as_bytes())
}

/// The trace's events as text, one per line, flushed to the writer in large pieces.
struct Events {
    out: String,
    first: bool,
}

impl Events {
    /// Starts the next event's line.
    fn next(&mut self) -> &mut String {
        if !self.first {
            self.out.push_str(",\n");
        }
        self.first = false;
        &mut self.out
    }

    /// A process's name and its place among the processes (its id).
    fn process(&mut self, pid: u64, name: &str) {
        let out = self.next();
        let _ = write!(
            out,
            "{{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":{pid},\"args\":{{\"name\":"
        );
        push_json_str(out, name);
        out.push_str("}}");
        let _ = write!(
            self.next(),
            "{{\"ph\":\"M\",\"name\":\"process_sort_index\",\"pid\":{pid},\"args\":{{\"sort_index\":{pid}}}}}"
        );
    }

    /// A track's name and its place among its process's tracks (its id).
    fn thread(&mut self, pid: u64, tid: u64, name: &str) {
        let out = self.next();
        let _ = write!(out, "{{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":{pid},\"tid\":{tid},\"args\":{{\"name\":");
        push_json_str(out, name);
        out.push_str("}}");
        let _ = write!(
            self.next(),
            "{{\"ph\":\"M\",\"name\":\"thread_sort_index\",\"pid\":{pid},\"tid\":{tid},\"args\":{{\"sort_index\":{tid}}}}}"
        );
    }

    /// A complete event on track `(pid, tid)` from `start` for `dur`, `args` the members of
    /// its arguments' object.
    fn slice(
        &mut self,
        name: &str,
        cat: &str,
        (pid, tid): (u64, u64),
        (start, dur): (Picos, Picos),
        args: &str,
    ) {
        let out = self.next();
        out.push_str("{\"ph\":\"X\",\"name\":");
        push_json_str(out, name);
        let _ = write!(
            out,
            ",\"cat\":\"{cat}\",\"pid\":{pid},\"tid\":{tid},\"ts\":"
        );
        push_micros(out, start);
        out.push_str(",\"dur\":");
        push_micros(out, dur);
        let _ = write!(out, ",\"args\":{{{args}}}}}");
    }

    fn flush_if_full(&mut self, w: &mut impl io::Write) -> io::Result<()> {
        if self.out.len() >= FLUSH_AT {
            w.write_all(self.out.as_bytes())?;
            self.out.clear();
        }
        Ok(())
    }
}

/// A lane for each span (spans in start order): the lowest-numbered one whose last span
/// has ended by this one's start, or a new one, so no two spans of a lane overlap.
fn lanes(spans: &[(Picos, Picos)]) -> Vec<usize> {
    let mut ends: Vec<Picos> = Vec::new();
    spans
        .iter()
        .map(|&(start, finish)| {
            let lane = ends
                .iter()
                .position(|&end| end <= start)
                .unwrap_or_else(|| {
                    ends.push(Picos::ZERO);
                    ends.len() - 1
                });
            ends[lane] = finish.max(start);
            lane
        })
        .collect()
}

/// The track of `endpoint`'s lane `lane`: unique within its host, and in endpoint, then
/// lane order.
fn track_id(endpoint: u32, lane: usize) -> u64 {
    (u64::from(endpoint) << 16) | lane as u64
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::flows::{CollectiveInfo, FlowSpec};
    use crate::sim::FlowOutcome;
    use orrery_units::Bytes;

    fn flow(src: u32, dst: u32, collective: u32) -> FlowSpec {
        FlowSpec {
            src,
            dst,
            bytes: Bytes(1000),
            deps: Default::default(),
            delay: Picos::ZERO,
            collective,
        }
    }

    fn outcome(start_ns: u64, finish_ns: u64) -> FlowOutcome {
        FlowOutcome {
            start: Picos::from_nanos(start_ns),
            finish: Picos::from_nanos(finish_ns),
        }
    }

    #[test]
    fn overlapping_spans_take_separate_lanes_and_free_ones_are_reused() {
        let s = |a: u64, b: u64| (Picos(a), Picos(b));
        // 0: [0, 10); 1: [2, 5) overlaps 0; 2: [5, 8) follows 1 on its lane; 3: [6, 12)
        // overlaps 0 and 2; 4: [12, 13) finds lane 0 free again.
        let got = lanes(&[s(0, 10), s(2, 5), s(5, 8), s(6, 12), s(12, 13)]);
        assert_eq!(got, vec![0, 1, 1, 2, 0]);
    }

    /// Two hosts of two endpoints: endpoint 1 sends two overlapping flows (two lanes), the
    /// collectives' spans follow their flows, and the text is the trace format, golden.
    #[test]
    fn a_small_run_as_a_trace() {
        let flows = FlowSet {
            flows: vec![flow(1, 2, 0), flow(1, 3, 0), flow(2, 0, 1), flow(0, 1, 1)],
            collectives: ["ring \"a\"", "p2p"]
                .iter()
                .map(|n| CollectiveInfo {
                    name: n.to_string(),
                    kind: None,
                    ranks: Vec::new(),
                    bytes: Bytes(2000),
                })
                .collect(),
        };
        let report = SimReport {
            model: "packet".to_string(),
            flows: vec![
                outcome(0, 1500),
                outcome(200, 900),
                outcome(1500, 2500),
                outcome(0, 300),
            ],
            end: Picos::from_nanos(2500),
            ..Default::default()
        };
        let mut buf = Vec::new();
        write_flow_trace("small", &flows, &report, 2, &mut buf).unwrap();
        let text = String::from_utf8(buf).unwrap();
        expect_test::expect![[r#"
            {"traceEvents":[
            {"ph":"M","name":"process_name","pid":0,"args":{"name":"host 0"}},
            {"ph":"M","name":"process_sort_index","pid":0,"args":{"sort_index":0}},
            {"ph":"M","name":"thread_name","pid":0,"tid":0,"args":{"name":"GPU 0"}},
            {"ph":"M","name":"thread_sort_index","pid":0,"tid":0,"args":{"sort_index":0}},
            {"ph":"X","name":"p2p","cat":"flow","pid":0,"tid":0,"ts":0.000000,"dur":0.300000,"args":{"flow":3,"dst":1,"bytes":1000}},
            {"ph":"M","name":"thread_name","pid":0,"tid":65536,"args":{"name":"GPU 1"}},
            {"ph":"M","name":"thread_sort_index","pid":0,"tid":65536,"args":{"sort_index":65536}},
            {"ph":"M","name":"thread_name","pid":0,"tid":65537,"args":{"name":"GPU 1 · 2"}},
            {"ph":"M","name":"thread_sort_index","pid":0,"tid":65537,"args":{"sort_index":65537}},
            {"ph":"X","name":"ring \"a\"","cat":"flow","pid":0,"tid":65536,"ts":0.000000,"dur":1.500000,"args":{"flow":0,"dst":2,"bytes":1000}},
            {"ph":"X","name":"ring \"a\"","cat":"flow","pid":0,"tid":65537,"ts":0.200000,"dur":0.700000,"args":{"flow":1,"dst":3,"bytes":1000}},
            {"ph":"M","name":"process_name","pid":1,"args":{"name":"host 1"}},
            {"ph":"M","name":"process_sort_index","pid":1,"args":{"sort_index":1}},
            {"ph":"M","name":"thread_name","pid":1,"tid":131072,"args":{"name":"GPU 2"}},
            {"ph":"M","name":"thread_sort_index","pid":1,"tid":131072,"args":{"sort_index":131072}},
            {"ph":"X","name":"p2p","cat":"flow","pid":1,"tid":131072,"ts":1.500000,"dur":1.000000,"args":{"flow":2,"dst":0,"bytes":1000}},
            {"ph":"M","name":"process_name","pid":2,"args":{"name":"collectives"}},
            {"ph":"M","name":"process_sort_index","pid":2,"args":{"sort_index":2}},
            {"ph":"M","name":"thread_name","pid":2,"tid":0,"args":{"name":"lane 1"}},
            {"ph":"M","name":"thread_sort_index","pid":2,"tid":0,"args":{"sort_index":0}},
            {"ph":"M","name":"thread_name","pid":2,"tid":1,"args":{"name":"lane 2"}},
            {"ph":"M","name":"thread_sort_index","pid":2,"tid":1,"args":{"sort_index":1}},
            {"ph":"X","name":"ring \"a\"","cat":"collective","pid":2,"tid":0,"ts":0.000000,"dur":1.500000,"args":{"collective":0,"flows":2,"bytes":2000}},
            {"ph":"X","name":"p2p","cat":"collective","pid":2,"tid":1,"ts":0.000000,"dur":2.500000,"args":{"collective":1,"flows":2,"bytes":2000}}
            ],"displayTimeUnit":"ms","otherData":{"scenario":"small","model":"packet","end_us":2.500000,"flows":4}}
        "#]]
        .assert_eq(&text);
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["traceEvents"].as_array().unwrap().len(), 24);
    }
}
