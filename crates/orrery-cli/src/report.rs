//! Terminal rendering of predictions and validation results.

use orrery_predict::traces::TraceReport;
use orrery_predict::validation::ValidationReport;
use orrery_predict::{Breakdown, Prediction};
use orrery_units::Picos;
use std::fmt::Write;

fn ms(p: Picos) -> String {
    format!("{:.1} ms", p.as_millis_f64())
}

fn share(p: Picos, total: Picos) -> String {
    if total.0 == 0 {
        return "-".to_string();
    }
    format!("{:5.1}%", 100.0 * p.0 as f64 / total.0 as f64)
}

/// A table of (label, value, note) rows under a title, values right-aligned.
fn table(out: &mut String, title: &str, rows: &[(String, String, String)]) {
    let w0 = rows.iter().map(|r| r.0.len()).max().unwrap_or(0);
    let w1 = rows.iter().map(|r| r.1.len()).max().unwrap_or(0);
    let _ = writeln!(out, "{title}");
    let _ = writeln!(out, "{}", "-".repeat(title.len().max(w0 + w1 + 4)));
    for (a, b, c) in rows {
        let line = format!("  {a:<w0$}  {b:>w1$}  {c}");
        let _ = writeln!(out, "{}", line.trim_end());
    }
    out.push('\n');
}

/// The breakdown as table rows: part, milliseconds, share of the step.
fn breakdown_rows(b: &Breakdown) -> Vec<(String, String, String)> {
    let t = b.total;
    let part = |name: &str, v: Picos| (name.to_string(), ms(v), share(v, t));
    vec![
        part("compute: forward", b.compute_forward),
        part("compute: backward", b.compute_backward),
        part("compute: recompute", b.compute_recompute),
        part("optimizer", b.optimizer),
        part("exposed TP comm", b.exposed_tp),
        part("exposed CP comm", b.exposed_cp),
        part("exposed EP comm", b.exposed_ep),
        part("exposed PP comm", b.exposed_pp),
        part("exposed DP comm", b.exposed_dp),
        part("pipeline bubble", b.bubble),
        part("total", t),
    ]
}

/// The report of a trace replay.
pub fn trace_replay(r: &TraceReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "orrery replay: {} ranks, step time {:.3} ms",
        r.ranks,
        r.step_time.as_millis_f64()
    );
    if r.measured_ops > 0 {
        let _ = writeln!(
            out,
            "{} op durations taken from the traces, the rest from the cost model",
            r.measured_ops
        );
    }
    out.push('\n');
    let title = format!(
        "Where the time goes (rank {}, the last to finish)",
        r.critical_rank
    );
    table(&mut out, &title, &breakdown_rows(&r.breakdown));
    let rows: Vec<_> = r
        .per_rank
        .iter()
        .map(|s| {
            (
                format!("rank {}", s.rank),
                ms(s.end),
                format!("peak {:.2} GiB", s.peak_memory.as_gib()),
            )
        })
        .collect();
    table(&mut out, "Per rank: end of step and peak memory", &rows);
    out
}

/// The full human-readable prediction report.
pub fn prediction(p: &Prediction) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "orrery predict: {}", p.job);
    let _ = writeln!(
        out,
        "{} x {}, network model: {}\n",
        p.world_size, p.gpu, p.network_model
    );
    if let Some(t) = &p.network_simulation {
        let _ = writeln!(
            out,
            "network simulation: {} runs, {} events processed, ~{} skipped; memo {}/{} hits ({:.1}%)\n",
            t.simulations,
            t.events,
            t.accel.skipped_events,
            t.accel.memo_hits,
            t.accel.memo_lookups,
            100.0 * t.accel.memo_hit_rate()
        );
    }
    let row = |a: &str, b: String| (a.to_string(), b, String::new());
    table(
        &mut out,
        "Step",
        &[
            row("step time", format!("{:.3} s", p.step_time.as_secs_f64())),
            row("tokens / step", format!("{}", p.tokens_per_step)),
            row("tokens / s", format!("{:.0}", p.tokens_per_second)),
            row("model TFLOP/s per GPU", format!("{:.1}", p.tflops_per_gpu)),
            row("MFU", format!("{:.1}%", 100.0 * p.mfu)),
        ],
    );
    let title = format!(
        "Where the time goes (stage {}, the last to finish)",
        p.critical_stage
    );
    table(&mut out, &title, &breakdown_rows(&p.breakdown));
    let mut rows = Vec::new();
    for m in &p.memory {
        let verdict = if m.fits { "fits" } else { "OUT OF MEMORY" };
        let cats: Vec<String> = m
            .ledger
            .at_peak
            .iter()
            .filter(|(_, b)| b.0 > 0)
            .map(|(c, b)| format!("{} {:.1}", c.name(), b.as_gib()))
            .collect();
        rows.push((
            format!("stage {:>2} (rank {})", m.stage, m.rank),
            format!("{:.2} / {:.2} GiB", m.peak.as_gib(), m.usable.as_gib()),
            format!("{verdict}  [{}]", cats.join(", ")),
        ));
    }
    table(
        &mut out,
        "Peak memory per pipeline stage (GiB at peak by category)",
        &rows,
    );
    let verdict = if p.fits {
        "every rank fits in memory"
    } else {
        "at least one stage runs OUT OF MEMORY"
    };
    let _ = writeln!(out, "Verdict: {verdict}.");
    let _ = writeln!(
        out,
        "Replayed {} ops in {} events: {} symmetry classes standing for {} ranks.",
        p.graph_ops,
        p.replay_events,
        p.classes.len(),
        p.world_size
    );
    for w in &p.warnings {
        let _ = writeln!(out, "warning: {w}");
    }
    out
}

/// The validation table with per-row errors and the MAPE.
pub fn validation(r: &ValidationReport) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "Step times (published vs predicted)");
    let _ = writeln!(
        out,
        "{:<28} {:>6} {:>6} {:<10} {:>10} {:>10} {:>8} {:>6}",
        "source", "model", "GPUs", "recompute", "measured", "predicted", "error", "MFU"
    );
    for c in &r.step_times {
        let _ = writeln!(
            out,
            "{:<28} {:>6} {:>6} {:<10} {:>9.2}s {:>9.2}s {:>+7.1}% {:>5.1}%",
            c.source,
            c.model,
            c.gpus,
            c.recompute,
            c.measured_s,
            c.predicted_s,
            100.0 * c.error,
            100.0 * c.predicted_mfu
        );
    }
    let _ = writeln!(
        out,
        "step-time MAPE: {:.1}% over {} rows\n",
        100.0 * r.step_time_mape,
        r.step_times.len()
    );
    let mut sources: Vec<&str> = r.step_times.iter().map(|c| c.source.as_str()).collect();
    sources.dedup();
    let _ = writeln!(out, "Assumptions for settings the sources do not publish:");
    let mut seen = std::collections::BTreeSet::new();
    for src in sources {
        let a = orrery_predict::validation::assumptions(src);
        if seen.insert(a) {
            let _ = writeln!(out, "  {src}: {a}");
        }
    }
    out.push('\n');
    let _ = writeln!(out, "Model-state memory (ZeRO paper, Table 1)");
    let _ = writeln!(
        out,
        "{:>8} {:>6} {:>5} {:>10} {:>10} {:>8}",
        "params", "DP", "stage", "published", "predicted", "error"
    );
    for c in &r.memory {
        let _ = writeln!(
            out,
            "{:>7}B {:>6} {:>5} {:>9.2}G {:>9.2}G {:>+7.2}%",
            c.params_billion,
            c.dp,
            c.zero_stage,
            c.measured_gb,
            c.predicted_gb,
            100.0 * c.error
        );
    }
    let _ = writeln!(
        out,
        "model-state memory: max error {:.2}% over {} rows",
        100.0 * r.memory_max_error,
        r.memory.len()
    );
    out
}
