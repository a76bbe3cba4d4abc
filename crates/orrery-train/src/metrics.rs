//! Per-step metrics, their JSON-lines form, and the loss-curve SVG.

use plotters::prelude::*;
use serde::{Deserialize, Serialize};

/// What one optimizer step measured. Timing fields come from the caller's [`crate::Clock`], so
/// with a fixed clock the whole record is deterministic.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    /// Updates completed, counting this one (1 for the first step).
    pub step: u64,
    /// Mean training loss of this step's batch (over all ranks).
    pub loss: f32,
    /// Validation loss, when this step ended with an evaluation.
    pub val_loss: Option<f32>,
    pub lr: f64,
    /// Global gradient L2 norm before clipping.
    pub grad_norm: f32,
    /// Tokens processed per second in this step (all ranks).
    pub tokens_per_s: f64,
    pub step_seconds: f64,
    /// Time the optimizer reported waiting for preconditioner work.
    pub optimizer_wait_s: f64,
}

impl StepMetrics {
    /// One JSON object, no trailing newline.
    pub fn to_json_line(&self) -> String {
        // Serialising plain numbers and options cannot fail; fall back to a marker anyway
        // rather than panicking.
        serde_json::to_string(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }
}

const FONT: &str = "sans-serif";

/// Training loss per step and validation loss at each evaluation, as an SVG document.
pub fn loss_curve_svg(history: &[StepMetrics]) -> String {
    let mut svg = String::new();
    if let Err(e) = draw(&mut svg, history) {
        svg = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"640\" height=\"40\"><text x=\"8\" y=\"24\">loss chart failed: {e}</text></svg>"
        );
    }
    svg
}

fn draw(svg: &mut String, history: &[StepMetrics]) -> Result<(), Box<dyn std::error::Error>> {
    let train: Vec<(f64, f64)> = history
        .iter()
        .filter(|m| m.loss.is_finite())
        .map(|m| (m.step as f64, f64::from(m.loss)))
        .collect();
    let val: Vec<(f64, f64)> = history
        .iter()
        .filter_map(|m| {
            m.val_loss
                .filter(|v| v.is_finite())
                .map(|v| (m.step as f64, f64::from(v)))
        })
        .collect();
    let x_max = history.last().map_or(1.0, |m| m.step as f64).max(1.0);
    let ys = train.iter().chain(&val).map(|p| p.1);
    let y_max = ys.clone().fold(0.0f64, f64::max).max(1e-3) * 1.05;
    let y_min = ys.fold(f64::INFINITY, f64::min).min(y_max) * 0.95;
    let y_min = if y_min.is_finite() { y_min } else { 0.0 };

    let root = SVGBackend::with_string(svg, (800, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("Loss", (FONT, 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(55)
        .build_cartesian_2d(0.0..x_max, y_min..y_max)?;
    chart
        .configure_mesh()
        .x_label_formatter(&|v| format!("{v:.0}"))
        .x_desc("step")
        .y_desc("cross-entropy (nats/token)")
        .axis_desc_style((FONT, 14))
        .label_style((FONT, 12))
        .light_line_style(RGBColor(0xee, 0xee, 0xee))
        .draw()?;
    let blue = RGBColor(0x1f, 0x77, 0xb4);
    let orange = RGBColor(0xff, 0x7f, 0x0e);
    chart
        .draw_series(LineSeries::new(train, blue.stroke_width(2)))?
        .label("train")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], blue.stroke_width(2)));
    chart
        .draw_series(LineSeries::new(val.iter().copied(), orange.stroke_width(2)))?
        .label("validation")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], orange.stroke_width(2)));
    chart.draw_series(val.iter().map(|&p| Circle::new(p, 3, orange.filled())))?;
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font((FONT, 13))
        .position(SeriesLabelPosition::UpperRight)
        .draw()?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_line_and_svg() {
        let h: Vec<StepMetrics> = (1..=5)
            .map(|s| StepMetrics {
                step: s,
                loss: 5.0 - s as f32 * 0.5,
                val_loss: (s % 2 == 0).then_some(4.0),
                lr: 1e-3,
                grad_norm: 1.0,
                tokens_per_s: 100.0,
                step_seconds: 0.1,
                optimizer_wait_s: 0.0,
            })
            .collect();
        let line = h[1].to_json_line();
        assert!(
            line.starts_with("{\"step\":2,\"loss\":4.0,\"val_loss\":4.0"),
            "{line}"
        );
        let back: StepMetrics = serde_json::from_str(&line).unwrap();
        assert_eq!(back, h[1]);
        let svg = loss_curve_svg(&h);
        assert!(svg.starts_with("<svg"));
        assert!(svg.contains("validation"));
        assert_eq!(svg, loss_curve_svg(&h), "deterministic");
    }
}
