//! SVG charts drawn with `plotters`' SVG backend.
//!
//! Only the font-free text path is used: without the `ttf`/`ab_glyph` features plotters
//! estimates text extents and the SVG backend emits `<text>` elements that the viewer
//! renders with its own fonts, so no font files are needed to build or run.
//!
//! Both charts are pure functions of the prediction and therefore deterministic. Should
//! plotters ever report a drawing error (it only can when formatting into a `String`
//! fails), the chart is replaced by a small SVG that states the error rather than panicking.

use crate::{PredictOutput, Prediction, StageMemory};
use orrery_units::{Picos, GIB};
use plotters::coord::ranged1d::SegmentValue;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::error::Error;

type DrawResult = Result<(), Box<dyn Error>>;

/// Width of the memory chart in pixels.
const MEMORY_WIDTH: u32 = 1040;
/// Height of the memory chart in pixels.
const MEMORY_HEIGHT: u32 = 560;
/// Width of the legend panel at the right of the memory chart.
const LEGEND_WIDTH: u32 = 240;
/// Time buckets per line above which a memory line is thinned (keeping every bucket's
/// first, lowest, highest and last point, so peaks survive exactly).
const MAX_BUCKETS: usize = 1500;

/// Width of the breakdown chart in pixels.
const BREAKDOWN_WIDTH: u32 = 1000;
/// Height of one bar row of the breakdown chart in pixels.
const ROW_HEIGHT: u32 = 34;

const FONT: &str = "sans-serif";

/// Line and bar colours (Tableau 10), cycled.
const PALETTE: [RGBColor; 10] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0xe3, 0x77, 0xc2),
    RGBColor(0x7f, 0x7f, 0x7f),
    RGBColor(0xbc, 0xbd, 0x22),
    RGBColor(0x17, 0xbe, 0xcf),
];

/// Colour of the usable-HBM line.
const LIMIT_COLOR: RGBColor = RGBColor(0xc0, 0x00, 0x00);

fn ms(t: Picos) -> f64 {
    t.0 as f64 / 1e9
}

/// Allocated memory (GiB) over the step (ms), one line per pipeline stage, with the usable
/// HBM as a dashed horizontal line. Each line is a step function of the stage's memory
/// ledger, from time zero to the end of the step.
pub fn memory_timeline_svg(out: &PredictOutput) -> String {
    let mut svg = String::new();
    match draw_memory(&out.prediction, &mut svg) {
        Ok(()) => svg,
        Err(e) => error_svg(MEMORY_WIDTH, MEMORY_HEIGHT, "memory timeline", &*e),
    }
}

fn draw_memory(p: &Prediction, svg: &mut String) -> DrawResult {
    let end = ms(p.step_time);
    let lines: Vec<Vec<(f64, f64)>> = p
        .memory
        .iter()
        .map(|m| thin(step_points(m, p.step_time), end.max(f64::MIN_POSITIVE)))
        .collect();
    let usable = p.memory.first().map(|m| m.usable.as_gib());
    let top = p
        .memory
        .iter()
        .map(|m| m.peak.as_gib())
        .chain(usable)
        .fold(0.0_f64, f64::max);
    let x_max = if end > 0.0 { end } else { 1.0 };
    let y_max = if top > 0.0 { top * 1.08 } else { 1.0 };

    let root = SVGBackend::with_string(svg, (MEMORY_WIDTH, MEMORY_HEIGHT)).into_drawing_area();
    root.fill(&WHITE)?;
    let (plot, legend) = root.split_horizontally(MEMORY_WIDTH - LEGEND_WIDTH);
    let mut chart = ChartBuilder::on(&plot)
        .caption(
            format!("Allocated memory per pipeline stage: {}", p.job),
            (FONT, 20),
        )
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(65)
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)?;
    chart
        .configure_mesh()
        .x_label_formatter(&|v| tick(*v, x_max))
        .y_label_formatter(&|v| tick(*v, y_max))
        .x_desc("time (ms)")
        .y_desc("allocated (GiB)")
        .axis_desc_style((FONT, 15))
        .label_style((FONT, 12))
        .light_line_style(RGBColor(0xee, 0xee, 0xee))
        .draw()?;

    let mut entries: Vec<(String, RGBColor, bool)> = Vec::new();
    for (i, (m, pts)) in p.memory.iter().zip(&lines).enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        chart.draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))?;
        entries.push((
            format!(
                "stage {} (rank {}): {:.2} GiB",
                m.stage,
                m.rank,
                m.peak.as_gib()
            ),
            color,
            false,
        ));
    }
    if let Some(u) = usable {
        chart.draw_series(DashedLineSeries::new(
            [(0.0, u), (x_max, u)],
            8,
            5,
            LIMIT_COLOR.stroke_width(2),
        ))?;
        entries.push((format!("usable HBM: {u:.2} GiB"), LIMIT_COLOR, true));
    }

    // The legend, in its own panel so it never hides a line.
    // Rows shrink (down to a few pixels) so that deep pipelines still fit the panel.
    let room = (MEMORY_HEIGHT - 90) as usize;
    let step = (room / entries.len().max(1)).clamp(4, 20) as i32;
    let text = TextStyle::from((FONT, 13).into_font()).pos(Pos::new(HPos::Left, VPos::Center));
    let small = TextStyle::from((FONT, f64::from(step.clamp(4, 13))).into_font())
        .pos(Pos::new(HPos::Left, VPos::Center));
    legend.draw(&Text::new("peak per stage", (8, 44), text))?;
    for (i, (label, color, dashed)) in entries.iter().enumerate() {
        let y = 68 + step * i as i32;
        if *dashed {
            legend.draw(&PathElement::new(
                vec![(8, y), (16, y)],
                color.stroke_width(2),
            ))?;
            legend.draw(&PathElement::new(
                vec![(21, y), (29, y)],
                color.stroke_width(2),
            ))?;
        } else {
            legend.draw(&PathElement::new(
                vec![(8, y), (29, y)],
                color.stroke_width(2),
            ))?;
        }
        legend.draw(&Text::new(label.as_str(), (35, y), small.clone()))?;
    }
    root.present()?;
    Ok(())
}

/// The stage's allocated memory as a step function in (ms, GiB), from zero to `end`.
fn step_points(m: &StageMemory, end: Picos) -> Vec<(f64, f64)> {
    let events = &m.ledger.events;
    let mut pts = Vec::with_capacity(2 * events.len() + 2);
    let mut value = 0.0;
    pts.push((0.0, value));
    for (i, e) in events.iter().enumerate() {
        if events.get(i + 1).is_some_and(|n| n.time == e.time) {
            continue;
        }
        let x = ms(e.time);
        let v = e.allocated.0 as f64 / GIB;
        pts.push((x, value));
        pts.push((x, v));
        value = v;
    }
    let last = events.last().map_or(Picos::ZERO, |e| e.time);
    pts.push((ms(end.max(last)), value));
    pts.dedup();
    pts
}

/// An axis tick label with as many decimals as an axis spanning `span` needs.
fn tick(v: f64, span: f64) -> String {
    let decimals = match span {
        s if s >= 20.0 => 0,
        s if s >= 2.0 => 1,
        s if s >= 0.2 => 2,
        _ => 3,
    };
    format!("{v:.decimals$}")
}

/// Thins a line of many points: per time bucket keeps its first, lowest, highest and last
/// point, in order. Lines with few points are returned unchanged.
fn thin(pts: Vec<(f64, f64)>, x_max: f64) -> Vec<(f64, f64)> {
    if pts.len() <= 4 * MAX_BUCKETS {
        return pts;
    }
    let bucket = |x: f64| ((x / x_max * MAX_BUCKETS as f64) as usize).min(MAX_BUCKETS - 1);
    let mut out = Vec::with_capacity(4 * MAX_BUCKETS + 4);
    let mut start = 0;
    while start < pts.len() {
        let b = bucket(pts[start].0);
        let mut stop = start + 1;
        while stop < pts.len() && bucket(pts[stop].0) == b {
            stop += 1;
        }
        let (mut lo, mut hi) = (start, start);
        for i in start..stop {
            if pts[i].1 < pts[lo].1 {
                lo = i;
            }
            if pts[i].1 > pts[hi].1 {
                hi = i;
            }
        }
        let mut keep = [start, lo, hi, stop - 1];
        keep.sort_unstable();
        let mut prev = None;
        for k in keep {
            if prev != Some(k) {
                out.push(pts[k]);
                prev = Some(k);
            }
        }
        start = stop;
    }
    out
}

/// The breakdown's parts in chart order, with their values.
fn parts(p: &Prediction) -> [(&'static str, Picos); 10] {
    let b = &p.breakdown;
    [
        ("forward", b.compute_forward),
        ("backward", b.compute_backward),
        ("recompute", b.compute_recompute),
        ("optimizer", b.optimizer),
        ("exposed TP", b.exposed_tp),
        ("exposed CP", b.exposed_cp),
        ("exposed EP", b.exposed_ep),
        ("exposed PP", b.exposed_pp),
        ("exposed DP", b.exposed_dp),
        ("bubble", b.bubble),
    ]
}

/// Where the step time of the critical stage goes, in ms: a stacked bar of the whole step
/// on top, then one bar per part (forward, backward, recompute, optimizer, exposed TP, CP,
/// EP, PP and DP communication, pipeline bubble), each labelled with its value and share.
pub fn breakdown_svg(p: &Prediction) -> String {
    let rows = parts(p).len() as u32 + 1;
    let height = 110 + ROW_HEIGHT * rows;
    let mut svg = String::new();
    match draw_breakdown(p, &mut svg, height) {
        Ok(()) => svg,
        Err(e) => error_svg(BREAKDOWN_WIDTH, height, "step-time breakdown", &*e),
    }
}

fn draw_breakdown(p: &Prediction, svg: &mut String, height: u32) -> DrawResult {
    let parts = parts(p);
    let n = parts.len() as i32 + 1;
    let total = p.breakdown.total;
    let total_ms = ms(total);
    // Room at the right of the longest bar for its value label.
    let x_max = if total_ms > 0.0 { total_ms * 1.32 } else { 1.0 };
    // Row `r` from the top sits at segment `n - 1 - r` (the y axis grows upwards).
    let row = |r: i32| n - 1 - r;
    let label_of = |v: &SegmentValue<i32>| -> String {
        match v {
            SegmentValue::CenterOf(y) | SegmentValue::Exact(y) => {
                let r = n - 1 - *y;
                if r == 0 {
                    "step".to_string()
                } else {
                    usize::try_from(r - 1)
                        .ok()
                        .and_then(|k| parts.get(k))
                        .map_or_else(String::new, |(name, _)| (*name).to_string())
                }
            }
            SegmentValue::Last => String::new(),
        }
    };

    let root = SVGBackend::with_string(svg, (BREAKDOWN_WIDTH, height)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "Step time breakdown: {} (critical stage {}, step {:.3} ms)",
                p.job, p.critical_stage, total_ms
            ),
            (FONT, 20),
        )
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(100)
        .build_cartesian_2d(0.0..x_max, (0..n - 1).into_segmented())?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(n as usize)
        .y_label_formatter(&label_of)
        .x_label_formatter(&|v| tick(*v, x_max))
        .x_desc("time (ms)")
        .axis_desc_style((FONT, 15))
        .label_style((FONT, 13))
        .light_line_style(RGBColor(0xee, 0xee, 0xee))
        .draw()?;

    let text = TextStyle::from((FONT, 13).into_font()).pos(Pos::new(HPos::Left, VPos::Center));
    let pad = x_max * 0.008;
    let share = |t: Picos| {
        if total.0 == 0 {
            0.0
        } else {
            100.0 * t.0 as f64 / total.0 as f64
        }
    };
    let bar = |x0: f64, x1: f64, y: i32, color: RGBColor| {
        let mut r = Rectangle::new(
            [
                (x0, SegmentValue::Exact(y)),
                (x1, SegmentValue::Exact(y + 1)),
            ],
            color.filled(),
        );
        r.set_margin(5, 5, 0, 0);
        r
    };

    // The whole step, stacked.
    let mut x = 0.0;
    let mut stacked = Vec::new();
    for (k, (_, t)) in parts.iter().enumerate() {
        let w = ms(*t);
        if w > 0.0 {
            stacked.push(bar(x, x + w, row(0), PALETTE[k % PALETTE.len()]));
        }
        x += w;
    }
    chart.draw_series(stacked)?;
    chart.draw_series(std::iter::once(Text::new(
        format!("{total_ms:.3} ms"),
        (x + pad, SegmentValue::CenterOf(row(0))),
        text.clone(),
    )))?;

    // One bar per part.
    for (k, (_, t)) in parts.iter().enumerate() {
        let y = row(k as i32 + 1);
        let w = ms(*t);
        if w > 0.0 {
            chart.draw_series(std::iter::once(bar(0.0, w, y, PALETTE[k % PALETTE.len()])))?;
        }
        chart.draw_series(std::iter::once(Text::new(
            format!("{w:.3} ms ({:.1}%)", share(*t)),
            (w + pad, SegmentValue::CenterOf(y)),
            text.clone(),
        )))?;
    }
    root.present()?;
    Ok(())
}

/// A minimal SVG that states why a chart could not be drawn.
fn error_svg(width: u32, height: u32, what: &str, e: &dyn Error) -> String {
    let msg: String = format!("could not draw the {what}: {e}")
        .chars()
        .map(|c| match c {
            '<' | '>' | '&' | '"' | '\'' => ' ',
            c => c,
        })
        .collect();
    format!(
        "<svg width=\"{width}\" height=\"{height}\" viewBox=\"0 0 {width} {height}\" xmlns=\"http://www.w3.org/2000/svg\">\n<text x=\"10\" y=\"30\" font-family=\"{FONT}\" font-size=\"14\">{msg}</text>\n</svg>\n"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thinning_keeps_the_extremes() {
        let pts: Vec<(f64, f64)> = (0..100_000)
            .map(|i| (i as f64, ((i * 7919) % 1000) as f64))
            .collect();
        let thinned = thin(pts.clone(), 100_000.0);
        assert!(thinned.len() <= 4 * MAX_BUCKETS);
        let max = |v: &[(f64, f64)]| v.iter().map(|p| p.1).fold(f64::MIN, f64::max);
        assert_eq!(max(&thinned), max(&pts));
        assert_eq!(thinned.first(), pts.first());
        assert_eq!(thinned.last(), pts.last());
        assert!(thinned.windows(2).all(|w| w[0].0 <= w[1].0));
    }
}
