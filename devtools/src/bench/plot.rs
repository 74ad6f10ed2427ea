//! The report's plots, drawn by `plotters` into SVG files (no system fonts: SVG text is laid out by the viewer;
//! plotters only estimates label widths).

use std::path::Path;

use plotters::prelude::*;

/// One named line.
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

impl Series {
    pub fn new(name: impl Into<String>, points: Vec<(f64, f64)>) -> Series {
        Series {
            name: name.into(),
            points,
        }
    }

    /// The empirical distribution of `samples` up to the `upto` quantile (the far tail would squash the rest):
    /// (value, percent of samples at or below it), at most ~200 points so the file stays small.
    pub fn cdf(name: impl Into<String>, samples: &[f64], upto: f64) -> Series {
        let mut s: Vec<f64> = samples.iter().copied().filter(|v| v.is_finite()).collect();
        s.sort_by(|a, b| a.total_cmp(b));
        let n = s.len();
        let keep = ((n as f64 * upto).ceil() as usize).clamp(n.min(1), n);
        let step = keep.div_ceil(200).max(1);
        let mut points: Vec<(f64, f64)> = (0..keep)
            .step_by(step)
            .map(|i| (s[i], 100.0 * (i + 1) as f64 / n as f64))
            .collect();
        if keep > 0 && !(keep - 1).is_multiple_of(step) {
            points.push((s[keep - 1], 100.0 * keep as f64 / n as f64));
        }
        Series::new(name, points)
    }
}

/// How the x axis is drawn.
#[derive(Clone, Copy, PartialEq)]
pub enum XScale {
    Linear,
    Log,
}

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

fn bounds(series: &[Series], pick: impl Fn(&(f64, f64)) -> f64) -> (f64, f64) {
    let vals = series
        .iter()
        .flat_map(|s| s.points.iter().map(&pick))
        .filter(|v| v.is_finite());
    let (lo, hi) = vals.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if lo.is_finite() { (lo, hi) } else { (0.0, 1.0) }
}

/// Draws `series` as lines with markers into an SVG file at `path`.
pub fn lines(
    path: &Path,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    x_scale: XScale,
    series: &[Series],
) -> anyhow::Result<()> {
    let (x0, x1) = bounds(series, |p| p.0);
    let (_, y1) = bounds(series, |p| p.1);
    let y_range = 0.0..(y1 * 1.1).max(1e-9);
    let root = SVGBackend::new(path, (860, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut builder = ChartBuilder::on(&root);
    builder
        .caption(title, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(75);
    match x_scale {
        XScale::Log => {
            let lo = (x0 * 0.8).max(1e-9);
            let mut chart = builder
                .build_cartesian_2d((lo..x1 * 1.25).log_scale(), y_range)
                .map_err(err)?;
            chart
                .configure_mesh()
                .x_desc(x_desc)
                .y_desc(y_desc)
                .x_label_formatter(&|v| format!("{v:.0}"))
                // Small values (dollars) keep two decimals.
                .y_label_formatter(&|v| {
                    if y1 < 10.0 {
                        format!("{v:.2}")
                    } else {
                        format!("{v:.0}")
                    }
                })
                .draw()
                .map_err(err)?;
            for (i, s) in series.iter().enumerate() {
                let c = COLORS[i % COLORS.len()];
                chart
                    .draw_series(LineSeries::new(s.points.iter().copied(), c.stroke_width(2)))
                    .map_err(err)?
                    .label(s.name.as_str())
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2))
                    });
                chart
                    .draw_series(s.points.iter().map(|&p| Circle::new(p, 4, c.filled())))
                    .map_err(err)?;
            }
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::LowerRight)
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .draw()
                .map_err(err)?;
        }
        XScale::Linear => {
            let pad = ((x1 - x0) * 0.03).max(1e-6);
            let mut chart = builder
                .build_cartesian_2d((x0 - pad).max(0.0)..x1 + pad, y_range)
                .map_err(err)?;
            chart
                .configure_mesh()
                .x_desc(x_desc)
                .y_desc(y_desc)
                .draw()
                .map_err(err)?;
            for (i, s) in series.iter().enumerate() {
                let c = COLORS[i % COLORS.len()];
                chart
                    .draw_series(LineSeries::new(s.points.iter().copied(), c.stroke_width(2)))
                    .map_err(err)?
                    .label(s.name.as_str())
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2))
                    });
            }
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::LowerRight)
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .draw()
                .map_err(err)?;
        }
    }
    root.present().map_err(err)?;
    Ok(())
}

fn err(e: impl std::fmt::Display) -> anyhow::Error {
    anyhow::anyhow!("drawing a plot: {e}")
}
