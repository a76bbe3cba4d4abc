//! Chrome / Perfetto trace-event JSON.
//!
//! The file is `{"traceEvents":[...],"displayTimeUnit":"ms","otherData":{...}}` with one
//! event per line (so diffs and golden tests stay readable). Per participant, in order:
//!
//! - metadata: `process_name` (`stage S (rank R)`), `process_sort_index`, and for every
//!   stream the participant uses, `thread_name` ([`Stream::name`]) and `thread_sort_index`;
//! - a complete event (`"ph":"X"`) per op on a stream (compute, collective, send) whose
//!   duration is nonzero, in issue order: `name` = op name, `cat` = phase, `args` with the
//!   op's kind, bytes, FLOPs, group or peer, and micro-batch;
//! - an instant event (`"ph":"i"`, thread scope) per receive, at the time its data arrived;
//! - a counter event (`"ph":"C"`, `name` `memory`, arg `allocated_gib`) per distinct time
//!   the participant's allocated memory changes.
//!
//! `ts` and `dur` are microseconds printed with exactly six decimals from integer
//! picoseconds, so the trace loses no precision and is byte-identical across runs.

use crate::memory::{self, MemoryLedger};
use crate::replay::{ParticipantTimeline, ReplayMode, Timeline};
use crate::PredictOutput;
use orrery_graph::{CollectiveOp, ComputeKind, ExecGraph, Op, OpKind, PeerStage, Phase, Stream};
use orrery_units::trace_text::{push_json_str, push_micros};
use orrery_units::{Bytes, Picos};
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io;

/// Options for [`write_perfetto_trace_with`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TraceOptions<'a> {
    /// Write at most this many participants (`None`: all). The first participant of every
    /// symmetry class (pipeline stage) is kept first, in class order, then the remaining
    /// participants in timeline order; the chosen ones are written in timeline order. This
    /// keeps an all-rank replay of a large job down to a size trace viewers can open while
    /// still showing every stage.
    pub max_participants: Option<usize>,
    /// Track names by timeline participant (`None`: `stage S (rank R)`), such as hybrid
    /// emulation's real and virtual ranks.
    pub labels: Option<&'a [String]>,
}

/// Writes the whole replayed step as Chrome / Perfetto trace-event JSON.
pub fn write_perfetto_trace(out: &PredictOutput, w: &mut impl io::Write) -> io::Result<()> {
    write_perfetto_trace_with(out, &TraceOptions::default(), w)
}

/// Buffered bytes above which the trace is flushed into the writer.
const FLUSH_AT: usize = 1 << 20;

/// What a trace says about its run in `otherData`, besides its participants.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceMeta {
    pub job: String,
    pub gpu: String,
    pub network_model: String,
    pub world_size: u64,
    pub step_time: Picos,
    pub mfu: f64,
}

/// Writes the replayed step as Chrome / Perfetto trace-event JSON, limited by `opts`.
///
/// Fails only if the writer fails, or (`InvalidData`) if a participant's memory ledger is
/// inconsistent, which would be a bug in a graph builder.
pub fn write_perfetto_trace_with(
    out: &PredictOutput,
    opts: &TraceOptions<'_>,
    w: &mut impl io::Write,
) -> io::Result<()> {
    let p = &out.prediction;
    let meta = TraceMeta {
        job: p.job.clone(),
        gpu: p.gpu.clone(),
        network_model: p.network_model.clone(),
        world_size: p.world_size,
        step_time: p.step_time,
        mfu: p.mfu,
    };
    write_trace(
        &out.graphs,
        &out.timeline,
        &|part| {
            out.prediction
                .memory
                .iter()
                .find(|m| m.rank == part.rank)
                .map(|m| &m.ledger)
        },
        &meta,
        opts,
        w,
    )
}

/// Writes any replayed timeline of `graphs` (an emulation's, say) as a trace.
pub fn write_timeline_trace(
    graphs: &orrery_graph::JobGraphs,
    timeline: &Timeline,
    meta: &TraceMeta,
    opts: &TraceOptions<'_>,
    w: &mut impl io::Write,
) -> io::Result<()> {
    write_trace(graphs, timeline, &|_| None, meta, opts, w)
}

type KnownLedger<'a> = dyn Fn(&ParticipantTimeline) -> Option<&'a MemoryLedger> + 'a;

fn write_trace<'a>(
    graphs: &orrery_graph::JobGraphs,
    timeline: &Timeline,
    known: &KnownLedger<'a>,
    meta: &TraceMeta,
    opts: &TraceOptions<'_>,
    w: &mut impl io::Write,
) -> io::Result<()> {
    let chosen = select(timeline, opts.max_participants);
    let mut ev = Events {
        buf: String::with_capacity(1 << 16),
        first: true,
    };
    ev.buf.push_str("{\"traceEvents\":[\n");
    for (order, &pi) in chosen.iter().enumerate() {
        let part = &timeline.participants[pi];
        let Some(graph) = graphs.classes.get(part.class.index()) else {
            continue;
        };
        let stage = graphs.layout.coords(part.rank).pp;
        let ledger = ledger_for(known, graph, part)?;
        let default_label = format!("stage {stage} (rank {})", part.rank.0);
        let label = opts
            .labels
            .and_then(|l| l.get(pi))
            .map_or(default_label.as_str(), String::as_str);
        write_participant(&mut ev, graph, part, label, order, &ledger);
        if ev.buf.len() >= FLUSH_AT {
            w.write_all(ev.buf.as_bytes())?;
            ev.buf.clear();
        }
    }
    let p = meta;
    let buf = &mut ev.buf;
    buf.push_str(
        "\n],\n\"displayTimeUnit\":\"ms\",\n\"otherData\":{\"generator\":\"orrery\",\"job\":",
    );
    push_json_str(buf, &p.job);
    buf.push_str(",\"gpu\":");
    push_json_str(buf, &p.gpu);
    buf.push_str(",\"network_model\":");
    push_json_str(buf, &p.network_model);
    let mode = match timeline.mode {
        ReplayMode::Classes => "classes",
        ReplayMode::AllRanks => "all_ranks",
    };
    let _ = write!(
        buf,
        ",\"replay_mode\":\"{mode}\",\"world_size\":{},\"step_time_us\":",
        p.world_size
    );
    push_micros(buf, p.step_time);
    buf.push_str(",\"mfu\":");
    push_f64(buf, p.mfu);
    let _ = writeln!(
        buf,
        ",\"participants\":{},\"participants_written\":{}}}}}",
        timeline.participants.len(),
        chosen.len()
    );
    w.write_all(ev.buf.as_bytes())
}

/// The participants to write, as indices into the timeline, in timeline order.
fn select(timeline: &Timeline, max: Option<usize>) -> Vec<usize> {
    let n = timeline.participants.len();
    let max = match max {
        Some(m) if m < n => m,
        _ => return (0..n).collect(),
    };
    let mut first_of_class = BTreeMap::new();
    for (i, p) in timeline.participants.iter().enumerate() {
        first_of_class.entry(p.class).or_insert(i);
    }
    let mut chosen = vec![false; n];
    let mut count = 0;
    let candidates = first_of_class.into_values().chain(0..n);
    for i in candidates {
        if count >= max {
            break;
        }
        if !chosen[i] {
            chosen[i] = true;
            count += 1;
        }
    }
    (0..n).filter(|&i| chosen[i]).collect()
}

/// The participant's memory ledger: the prediction's when it has one for this rank, else
/// computed from the graph and timing.
fn ledger_for<'a>(
    known: &KnownLedger<'a>,
    graph: &ExecGraph,
    part: &ParticipantTimeline,
) -> io::Result<Cow<'a, MemoryLedger>> {
    if let Some(m) = known(part) {
        return Ok(Cow::Borrowed(m));
    }
    if part.ops.len() != graph.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "rank {}: timeline has {} ops but its graph has {}",
                part.rank,
                part.ops.len(),
                graph.len()
            ),
        ));
    }
    memory::ledger(graph, part).map(Cow::Owned).map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("rank {}: {e}", part.rank),
        )
    })
}

/// The trace's event list: one event per line, comma-separated.
struct Events {
    buf: String,
    first: bool,
}

impl Events {
    /// Starts a new event and returns the buffer to write it into.
    fn next(&mut self) -> &mut String {
        if !self.first {
            self.buf.push_str(",\n");
        }
        self.first = false;
        &mut self.buf
    }
}

fn write_participant(
    ev: &mut Events,
    graph: &ExecGraph,
    part: &ParticipantTimeline,
    label: &str,
    order: usize,
    ledger: &MemoryLedger,
) {
    let pid = part.rank.0;
    let buf = ev.next();
    let _ = write!(
        buf,
        "{{\"ph\":\"M\",\"pid\":{pid},\"tid\":0,\"name\":\"process_name\",\"args\":{{\"name\":"
    );
    push_json_str(buf, label);
    buf.push_str("}}");
    let buf = ev.next();
    let _ = write!(
        buf,
        "{{\"ph\":\"M\",\"pid\":{pid},\"tid\":0,\"name\":\"process_sort_index\",\"args\":{{\"sort_index\":{order}}}}}"
    );
    let mut used = [false; Stream::ALL.len()];
    for (op, t) in graph.ops().iter().zip(&part.ops) {
        let shown = match op.kind {
            OpKind::Recv { .. } => true,
            OpKind::Compute { .. } | OpKind::Collective { .. } | OpKind::Send { .. } => {
                t.end > t.start
            }
            OpKind::Alloc { .. } | OpKind::Free { .. } => false,
        };
        if shown {
            used[op.stream.index()] = true;
        }
    }
    for s in Stream::ALL {
        if !used[s.index()] {
            continue;
        }
        let tid = s.index();
        let name = s.name();
        let buf = ev.next();
        let _ = write!(
            buf,
            "{{\"ph\":\"M\",\"pid\":{pid},\"tid\":{tid},\"name\":\"thread_name\",\"args\":{{\"name\":\"{name}\"}}}}"
        );
        let buf = ev.next();
        let _ = write!(
            buf,
            "{{\"ph\":\"M\",\"pid\":{pid},\"tid\":{tid},\"name\":\"thread_sort_index\",\"args\":{{\"sort_index\":{tid}}}}}"
        );
    }
    for (op, t) in graph.ops().iter().zip(&part.ops) {
        match op.kind {
            OpKind::Compute { .. } | OpKind::Collective { .. } | OpKind::Send { .. } => {
                if t.end <= t.start {
                    continue;
                }
                let buf = ev.next();
                let _ = write!(
                    buf,
                    "{{\"ph\":\"X\",\"pid\":{pid},\"tid\":{},\"ts\":",
                    op.stream.index()
                );
                push_micros(buf, t.start);
                buf.push_str(",\"dur\":");
                push_micros(buf, t.end - t.start);
                push_name_cat_args(buf, graph, op);
            }
            OpKind::Recv { .. } => {
                let buf = ev.next();
                let _ = write!(
                    buf,
                    "{{\"ph\":\"i\",\"s\":\"t\",\"pid\":{pid},\"tid\":{},\"ts\":",
                    op.stream.index()
                );
                push_micros(buf, t.end);
                push_name_cat_args(buf, graph, op);
            }
            OpKind::Alloc { .. } | OpKind::Free { .. } => {}
        }
    }
    let events = &ledger.events;
    for (i, e) in events.iter().enumerate() {
        // Several changes at one instant: only the value after the last one is shown.
        if events.get(i + 1).is_some_and(|n| n.time == e.time) {
            continue;
        }
        let buf = ev.next();
        let _ = write!(buf, "{{\"ph\":\"C\",\"pid\":{pid},\"tid\":0,\"ts\":");
        push_micros(buf, e.time);
        buf.push_str(",\"name\":\"memory\",\"args\":{\"allocated_gib\":");
        push_gib(buf, e.allocated);
        buf.push_str("}}");
    }
}

/// `,"name":...,"cat":...,"args":{...}}`: the rest of an op's event.
fn push_name_cat_args(buf: &mut String, graph: &ExecGraph, op: &Op) {
    buf.push_str(",\"name\":");
    push_json_str(buf, graph.name_of(op));
    let _ = write!(buf, ",\"cat\":\"{}\",\"args\":{{", phase_name(op.phase));
    match op.kind {
        OpKind::Compute { kind, flops, bytes } => {
            let kind = match kind {
                ComputeKind::Gemm { .. } => "gemm",
                ComputeKind::Attention { .. } => "attention",
                ComputeKind::MemoryBound => "memory_bound",
            };
            let _ = write!(buf, "\"kind\":\"{kind}\",\"flops\":");
            push_f64(buf, flops.0.round());
            let _ = write!(buf, ",\"bytes\":{}", bytes.0);
        }
        OpKind::Collective {
            op: c,
            group,
            bytes,
        } => {
            let _ = write!(
                buf,
                "\"kind\":\"{}\",\"group\":\"{}\",\"bytes\":{}",
                collective_name(c),
                group.name(),
                bytes.0
            );
        }
        OpKind::Send { peer, bytes, tag } => {
            let _ = write!(
                buf,
                "\"kind\":\"send\",\"peer\":\"{}\",\"bytes\":{},\"tag\":{tag}",
                peer_name(peer),
                bytes.0
            );
        }
        OpKind::Recv { peer, bytes, tag } => {
            let _ = write!(
                buf,
                "\"kind\":\"recv\",\"peer\":\"{}\",\"bytes\":{},\"tag\":{tag}",
                peer_name(peer),
                bytes.0
            );
        }
        OpKind::Alloc { .. } | OpKind::Free { .. } => {}
    }
    if let Some(mb) = op.microbatch {
        let _ = write!(buf, ",\"microbatch\":{mb}");
    }
    buf.push_str("}}");
}

fn phase_name(p: Phase) -> &'static str {
    match p {
        Phase::Forward => "forward",
        Phase::Backward => "backward",
        Phase::Recompute => "recompute",
        Phase::Optimizer => "optimizer",
    }
}

fn collective_name(c: CollectiveOp) -> &'static str {
    match c {
        CollectiveOp::AllReduce => "all_reduce",
        CollectiveOp::AllGather => "all_gather",
        CollectiveOp::ReduceScatter => "reduce_scatter",
        CollectiveOp::AllToAll => "all_to_all",
        CollectiveOp::Broadcast => "broadcast",
    }
}

fn peer_name(p: PeerStage) -> &'static str {
    match p {
        PeerStage::Prev => "prev",
        PeerStage::Next => "next",
    }
}

/// Bytes as GiB with six decimals, rounded half up with integer arithmetic.
fn push_gib(buf: &mut String, b: Bytes) {
    let micro = (u128::from(b.0) * 1_000_000 + (1 << 29)) >> 30;
    let _ = write!(buf, "{}.{:06}", micro / 1_000_000, micro % 1_000_000);
}

/// A float as a JSON number (`null` when not finite). Rust's `Display` for `f64` is exact
/// shortest round-trip and never uses an exponent, so the text is valid JSON and stable.
fn push_f64(buf: &mut String, x: f64) {
    if x.is_finite() {
        let _ = write!(buf, "{x}");
    } else {
        buf.push_str("null");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_exact_and_fixed() {
        let mut s = String::new();
        push_micros(&mut s, Picos(1_234_567_890));
        s.push(' ');
        push_micros(&mut s, Picos(5));
        s.push(' ');
        push_gib(&mut s, Bytes(3 << 29));
        s.push(' ');
        push_gib(&mut s, Bytes(1));
        s.push(' ');
        push_json_str(&mut s, "a\"b\\c\u{1}");
        s.push(' ');
        push_f64(&mut s, f64::NAN);
        s.push(' ');
        push_f64(&mut s, 1e21);
        assert_eq!(
            s,
            r#"1234.567890 0.000005 1.500000 0.000000 "a\"b\\c\u0001" null 1000000000000000000000"#
        );
    }
}
