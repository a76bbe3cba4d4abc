//! Sinks: the formats people already open, written from a [`PredictOutput`].
//!
//! - [`write_perfetto_trace`] / [`write_perfetto_trace_with`]: Chrome / Perfetto trace-event
//!   JSON (open in <https://ui.perfetto.dev> or `chrome://tracing`). One process per replayed
//!   participant (`pid` = rank, named `stage S (rank R)`), one thread per stream (`tid` =
//!   [`Stream::index`](orrery_graph::Stream::index), named [`Stream::name`](orrery_graph::Stream::name)),
//!   a complete event per on-stream op that takes time, an instant event per receive, and a
//!   counter track with the participant's allocated memory in GiB.
//! - [`memory_timeline_svg`]: allocated memory over the step, one line per pipeline stage,
//!   with the usable HBM as a dashed line.
//! - [`breakdown_svg`]: where the step time goes, one bar per part plus a stacked bar.
//!
//! Every sink is deterministic: the same prediction gives the same bytes. Times are written
//! from integer picoseconds with integer arithmetic (microseconds with six decimals in the
//! trace), and no hash-map order reaches an output. Charts are drawn with `plotters`' SVG
//! backend and its font-free text path (SVG `<text>` elements), so no font files are needed.
//!
//! Like the rest of the crate, sinks never touch the file system: the trace is written into
//! any [`std::io::Write`], and charts are returned as `String`s for the caller to store.
//!
//! [`PredictOutput`]: crate::PredictOutput

mod perfetto;
mod svg;

pub use perfetto::{
    write_perfetto_trace, write_perfetto_trace_with, write_timeline_trace, TraceMeta, TraceOptions,
};
pub use svg::{breakdown_svg, memory_timeline_svg};
