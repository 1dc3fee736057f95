//! The length sweep as a log-log PNG: output error (left) and state error (right) against
//! decode length, one line per 2-byte pool.
//!
//! Text (title, axis labels, legend) needs a system font through fontconfig. Where none can be
//! loaded, the plot is drawn again without text rather than failing, and the caller is told.

use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;
use state_pool::Dtype;

use super::sweep::{SweepResult, SweepSeries};
use super::RoundingKind;

/// Size of the PNG in pixels.
const SIZE: (u32, u32) = (1400, 620);

/// Whether the plot has its text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlotText {
    /// Title, axis labels and legend drawn.
    Drawn,
    /// No font could be loaded: lines and grid only.
    Omitted,
}

/// Draws `sweep` to `path` (PNG). `title` heads the picture.
pub fn draw(path: &Path, sweep: &SweepResult, title: &str) -> Result<PlotText, String> {
    match render(path, sweep, Some(title)) {
        Ok(()) => Ok(PlotText::Drawn),
        Err(with_text) => match render(path, sweep, None) {
            Ok(()) => {
                tracing::warn!("plot drawn without text (no usable font: {with_text})");
                Ok(PlotText::Omitted)
            }
            Err(e) => Err(format!("cannot draw {}: {e}", path.display())),
        },
    }
}

fn color(dtype: Dtype, rounding: RoundingKind) -> RGBColor {
    match (dtype, rounding) {
        (Dtype::Bf16, RoundingKind::Nearest) => RGBColor(214, 39, 40),
        (Dtype::Bf16, RoundingKind::Stochastic) => RGBColor(255, 127, 14),
        (_, RoundingKind::Nearest) => RGBColor(31, 119, 180),
        (_, RoundingKind::Stochastic) => RGBColor(44, 160, 44),
    }
}

/// The positive finite range of all values, padded, for a log axis.
fn value_range(values: impl Iterator<Item = f64>) -> std::ops::Range<f64> {
    let (lo, hi) = values
        .filter(|v| v.is_finite() && *v > 0.0)
        .fold((f64::MAX, f64::MIN), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if lo > hi {
        1e-8..1.0
    } else {
        lo / 2.0..hi * 2.0
    }
}

/// `1K`, `64K`, `1M` for powers of two; the number otherwise.
fn short_length(x: f64) -> String {
    let n = x.round() as u64;
    if n >= 1 << 20 && n.is_multiple_of(1 << 20) {
        format!("{}M", n >> 20)
    } else if n >= 1024 && n.is_multiple_of(1024) {
        format!("{}K", n >> 10)
    } else {
        n.to_string()
    }
}

fn render(path: &Path, sweep: &SweepResult, title: Option<&str>) -> Result<(), String> {
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let body = match title {
        Some(t) => root
            .titled(t, ("sans-serif", 22))
            .map_err(|e| e.to_string())?,
        None => root.clone(),
    };
    let panels = body.split_evenly((1, 2));
    let outputs = |s: &SweepSeries| s.output_rel_err.clone();
    let states = |s: &SweepSeries| s.state_rel_err.clone();
    panel(
        &panels[0],
        sweep,
        "output error (steps since the previous length)",
        &outputs,
        title.is_some(),
    )?;
    panel(&panels[1], sweep, "state error", &states, title.is_some())?;
    root.present().map_err(|e| e.to_string())
}

fn panel(
    area: &DrawingArea<BitMapBackend<'_>, Shift>,
    sweep: &SweepResult,
    caption: &str,
    metric: &dyn Fn(&SweepSeries) -> Vec<f64>,
    text: bool,
) -> Result<(), String> {
    let lengths = &sweep.spec.lengths;
    let x_lo = *lengths.first().unwrap_or(&1) as f64 / 1.3;
    let x_hi = *lengths.last().unwrap_or(&2) as f64 * 1.3;
    let mut y = value_range(sweep.series.iter().flat_map(metric));
    if text {
        // Room above the lines for the legend.
        y.end *= 8.0;
    }
    let mut builder = ChartBuilder::on(area);
    builder.margin(12);
    if text {
        builder
            .caption(caption, ("sans-serif", 18))
            .x_label_area_size(45)
            .y_label_area_size(75);
    }
    let mut chart = builder
        .build_cartesian_2d((x_lo..x_hi).log_scale().base(2.0), y.log_scale())
        .map_err(|e| e.to_string())?;
    let mut mesh = chart.configure_mesh();
    mesh.light_line_style(WHITE)
        .bold_line_style(RGBColor(215, 215, 215));
    if text {
        mesh.x_desc("decode length (tokens)")
            .y_desc("relative Frobenius error vs fp32 pool")
            .x_label_formatter(&|x| short_length(*x))
            .y_label_formatter(&|y| format!("{y:.0e}"));
    } else {
        // Grid lines at the bold key points only; no tick labels.
        mesh.x_label_formatter(&|_| String::new())
            .y_label_formatter(&|_| String::new());
    }
    mesh.draw().map_err(|e| e.to_string())?;
    for s in &sweep.series {
        let c = color(s.variant.state_dtype, s.variant.rounding);
        let points: Vec<(f64, f64)> = lengths
            .iter()
            .zip(metric(s))
            .filter(|(_, e)| e.is_finite() && *e > 0.0)
            .map(|(&l, e)| (l as f64, e))
            .collect();
        let label = s.variant.label();
        let style = c.stroke_width(2);
        let anno = if s.variant.ring_len == 0 {
            chart
                .draw_series(LineSeries::new(points.clone(), style))
                .map_err(|e| e.to_string())?
        } else {
            chart
                .draw_series(DashedLineSeries::new(points.clone(), 8, 5, style))
                .map_err(|e| e.to_string())?
        };
        if text {
            let dashed = s.variant.ring_len > 0;
            anno.label(label).legend(move |(x, y)| {
                let end = if dashed { x + 10 } else { x + 22 };
                PathElement::new(vec![(x, y), (end, y)], c.stroke_width(2))
            });
        }
        chart
            .draw_series(points.iter().map(|&p| Circle::new(p, 3, c.filled())))
            .map_err(|e| e.to_string())?;
    }
    if text {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 13))
            .draw()
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::accuracy::sweep::SweepSpec;
    use crate::accuracy::Variant;
    use crate::inputs::Dims;

    fn synthetic_sweep() -> SweepResult {
        let lengths = vec![1024, 2048, 4096, 8192];
        let series = Variant::two_byte(&[0, 8])
            .into_iter()
            .enumerate()
            .map(|(i, variant)| SweepSeries {
                variant,
                output_rel_err: lengths
                    .iter()
                    .map(|&l| 1e-4 * (1.0 + i as f64) * (l as f64 / 1024.0).sqrt())
                    .collect(),
                state_rel_err: lengths.iter().map(|_| 2e-4 * (1.0 + i as f64)).collect(),
            })
            .collect();
        SweepResult {
            spec: SweepSpec {
                dims: Dims {
                    h: 1,
                    hv: 1,
                    k: 128,
                    v: 128,
                },
                seqs: 1,
                lengths,
                rings: vec![0, 8],
                io_dtype: Dtype::Fp32,
                seed: 1,
            },
            series,
        }
    }

    #[test]
    fn plot_writes_a_png_of_the_sweep() {
        let dir = std::env::temp_dir().join(format!("kda-plot-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("sweep.png");
        draw(&path, &synthetic_sweep(), "test").expect("plot drawn");
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        assert!(
            bytes.len() > 10_000,
            "suspiciously small PNG: {} bytes",
            bytes.len()
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn plot_without_text_needs_no_font() {
        let dir = std::env::temp_dir().join(format!("kda-plot-notext-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("sweep.png");
        render(&path, &synthetic_sweep(), None).expect("plot drawn without text");
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn value_range_pads_positive_values_and_ignores_zero_and_nan() {
        let r = value_range([0.0, 1e-4, f64::NAN, 1e-2].into_iter());
        assert!((r.start - 5e-5).abs() < 1e-12 && (r.end - 2e-2).abs() < 1e-12);
        assert_eq!(value_range([0.0].into_iter()), 1e-8..1.0);
    }
}
