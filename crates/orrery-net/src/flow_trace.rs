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
use crate::sim::{FlowOutcome, SimReport};
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
    let mut out = String::with_capacity(1 << 16);
    out.push_str("{\"traceEvents\":[\n");
    let mut first = true;
    let mut event = |out: &mut String, text: &str| {
        if !first {
            out.push_str(",\n");
        }
        first = false;
        out.push_str(text);
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
    let collectives = collective_spans(flows, &report.flows);
    let mut line = String::new();
    let mut hosts_named = Vec::new();
    for group in by_source.chunk_by(|a, b| a.0 == b.0) {
        let src = group[0].0;
        let host = u64::from(src) / per_host;
        if hosts_named.last() != Some(&host) {
            hosts_named.push(host);
            line.clear();
            let _ = write!(
                line,
                "{{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":{host},\"args\":{{\"name\":\"host {host}\"}}}}"
            );
            event(&mut out, &line);
            line.clear();
            let _ = write!(
                line,
                "{{\"ph\":\"M\",\"name\":\"process_sort_index\",\"pid\":{host},\"args\":{{\"sort_index\":{host}}}}}"
            );
            event(&mut out, &line);
        }
        let spans: Vec<(Picos, Picos)> = group
            .iter()
            .map(|&(_, _, i)| (report.flows[i].start, report.flows[i].finish))
            .collect();
        let lanes = lanes(&spans);
        let used = lanes.iter().max().map_or(0, |&l| l + 1);
        for lane in 0..used {
            let tid = track_id(src, lane);
            line.clear();
            line.push_str("{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":");
            let _ = write!(line, "{host},\"tid\":{tid},\"args\":{{\"name\":");
            let name = if lane == 0 {
                format!("GPU {src}")
            } else {
                format!("GPU {src} · {}", lane + 1)
            };
            push_json_str(&mut line, &name);
            line.push_str("}}");
            event(&mut out, &line);
            line.clear();
            let _ = write!(
                line,
                "{{\"ph\":\"M\",\"name\":\"thread_sort_index\",\"pid\":{host},\"tid\":{tid},\"args\":{{\"sort_index\":{tid}}}}}"
            );
            event(&mut out, &line);
        }
        for (&(_, _, i), &lane) in group.iter().zip(&lanes) {
            let (f, o) = (&flows.flows[i], &report.flows[i]);
            line.clear();
            line.push_str("{\"ph\":\"X\",\"name\":");
            let name = flows
                .collectives
                .get(f.collective as usize)
                .map_or("flow", |c| c.name.as_str());
            push_json_str(&mut line, name);
            let _ = write!(
                line,
                ",\"cat\":\"flow\",\"pid\":{host},\"tid\":{},\"ts\":",
                track_id(src, lane)
            );
            push_us(&mut line, o.start);
            line.push_str(",\"dur\":");
            push_us(&mut line, o.fct());
            let _ = write!(
                line,
                ",\"args\":{{\"flow\":{i},\"dst\":{},\"bytes\":{}}}}}",
                f.dst, f.bytes.0
            );
            event(&mut out, &line);
        }
        if out.len() >= FLUSH_AT {
            w.write_all(out.as_bytes())?;
            out.clear();
        }
    }
    if !collectives.is_empty() {
        // After every host, whatever the hosts' numbers.
        let pid = hosts_named.last().map_or(0, |&h| h + 1);
        line.clear();
        let _ = write!(
            line,
            "{{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":{pid},\"args\":{{\"name\":\"collectives\"}}}}"
        );
        event(&mut out, &line);
        line.clear();
        let _ = write!(
            line,
            "{{\"ph\":\"M\",\"name\":\"process_sort_index\",\"pid\":{pid},\"args\":{{\"sort_index\":{pid}}}}}"
        );
        event(&mut out, &line);
        let spans: Vec<(Picos, Picos)> = collectives.iter().map(|c| (c.start, c.finish)).collect();
        let lanes = lanes(&spans);
        for lane in 0..lanes.iter().max().map_or(0, |&l| l + 1) {
            line.clear();
            let _ = write!(
                line,
                "{{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":{pid},\"tid\":{lane},\"args\":{{\"name\":\"lane {}\"}}}}",
                lane + 1
            );
            event(&mut out, &line);
        }
        for (c, &lane) in collectives.iter().zip(&lanes) {
            line.clear();
            line.push_str("{\"ph\":\"X\",\"name\":");
            push_json_str(&mut line, &flows.collectives[c.index].name);
            let _ = write!(
                line,
                ",\"cat\":\"collective\",\"pid\":{pid},\"tid\":{lane},\"ts\":"
            );
            push_us(&mut line, c.start);
            line.push_str(",\"dur\":");
            push_us(&mut line, Picos(c.finish.0.saturating_sub(c.start.0)));
            let _ = write!(
                line,
                ",\"args\":{{\"collective\":{},\"flows\":{},\"bytes\":{}}}}}",
                c.index, c.flows, c.bytes
            );
            event(&mut out, &line);
            if out.len() >= FLUSH_AT {
                w.write_all(out.as_bytes())?;
                out.clear();
            }
        }
    }
    out.push_str("\n],\"displayTimeUnit\":\"ms\",\"otherData\":{\"scenario\":");
    push_json_str(&mut out, scenario);
    out.push_str(",\"model\":");
    push_json_str(&mut out, &report.model);
    out.push_str(",\"end_us\":");
    push_us(&mut out, report.end);
    let _ = writeln!(out, ",\"flows\":{}}}}}", report.flows.len());
    w.write_all(out.as_bytes())
}

/// One collective's span in a run: its first flow's release to its last flow's finish.
struct CollectiveSpan {
    index: usize,
    start: Picos,
    finish: Picos,
    flows: usize,
    bytes: u64,
}

/// The collectives that have flows, in release order (ties by index).
fn collective_spans(flows: &FlowSet, outcomes: &[FlowOutcome]) -> Vec<CollectiveSpan> {
    let mut spans: Vec<CollectiveSpan> = (0..flows.collectives.len())
        .map(|index| CollectiveSpan {
            index,
            start: Picos(u64::MAX),
            finish: Picos::ZERO,
            flows: 0,
            bytes: 0,
        })
        .collect();
    for (f, o) in flows.flows.iter().zip(outcomes) {
        if let Some(c) = spans.get_mut(f.collective as usize) {
            c.start = c.start.min(o.start);
            c.finish = c.finish.max(o.finish);
            c.flows += 1;
            c.bytes += f.bytes.0;
        }
    }
    spans.retain(|c| c.flows > 0);
    spans.sort_by_key(|c| (c.start, c.index));
    spans
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

/// Picoseconds as microseconds with exactly six decimals (exact: 1 us = 10^6 ps).
fn push_us(buf: &mut String, t: Picos) {
    let _ = write!(buf, "{}.{:06}", t.0 / 1_000_000, t.0 % 1_000_000);
}

/// A JSON string literal.
fn push_json_str(buf: &mut String, s: &str) {
    buf.push('"');
    for c in s.chars() {
        match c {
            '"' => buf.push_str("\\\""),
            '\\' => buf.push_str("\\\\"),
            '\n' => buf.push_str("\\n"),
            '\r' => buf.push_str("\\r"),
            '\t' => buf.push_str("\\t"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(buf, "\\u{:04x}", u32::from(c));
            }
            c => buf.push(c),
        }
    }
    buf.push('"');
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::flows::{CollectiveInfo, FlowSpec};
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

    #[test]
    fn strings_are_escaped_as_json() {
        let mut buf = String::new();
        push_json_str(&mut buf, "a \"b\" \\ c\n\u{1}");
        assert_eq!(buf, r#""a \"b\" \\ c\n\u0001""#);
        let mut buf = String::new();
        push_us(&mut buf, Picos(1_234_567_890));
        assert_eq!(buf, "1234.567890");
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
            {"ph":"M","name":"thread_name","pid":2,"tid":1,"args":{"name":"lane 2"}},
            {"ph":"X","name":"ring \"a\"","cat":"collective","pid":2,"tid":0,"ts":0.000000,"dur":1.500000,"args":{"collective":0,"flows":2,"bytes":2000}},
            {"ph":"X","name":"p2p","cat":"collective","pid":2,"tid":1,"ts":0.000000,"dur":2.500000,"args":{"collective":1,"flows":2,"bytes":2000}}
            ],"displayTimeUnit":"ms","otherData":{"scenario":"small","model":"packet","end_us":2.500000,"flows":4}}
        "#]]
        .assert_eq(&text);
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["traceEvents"].as_array().unwrap().len(), 22);
    }
}
