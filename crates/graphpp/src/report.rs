//! The run report of `graphpp train --report DIR`: one self-contained HTML page (`DIR/index.html`;
//! inline CSS and inline SVG, no script, nothing fetched) with the run's strategy, the loss and
//! throughput curves, the measured timeline of the last steps beside the simulator's prediction
//! from the same steps' per-action times, and a table of every evaluation.
//!
//! Charts skip non-finite values (a diverged step never puts `NaN` into SVG coordinates) and draw at
//! most [`MAX_POINTS`] points per series, keeping the first and the last.

use std::fmt::Write;
use std::path::{Path, PathBuf};

use graphpp_schedule::render::{svg, xml_escape as esc};
use graphpp_schedule::Timeline;

use crate::metrics::StepRecord;

/// Most points drawn per chart series; longer series are thinned evenly, keeping both ends.
pub const MAX_POINTS: usize = 2000;

/// Chart geometry (SVG user units): the whole chart and its plot area `[LEFT, LEFT + PLOT_W] ×
/// [TOP, TOP + PLOT_H]`, which holds every series point.
const CHART_W: f64 = 760.0;
const CHART_H: f64 = 320.0;
const LEFT: f64 = 70.0;
const TOP: f64 = 30.0;
const PLOT_W: f64 = 670.0;
const PLOT_H: f64 = 240.0;
/// Values beyond this magnitude are treated as non-finite (keeps every range difference finite).
const HUGE: f64 = 1e300;

/// What the report shows. Built by `graphpp train` from its flags, metrics log and last measured
/// steps.
#[derive(Debug, Clone)]
pub struct RunReport<'a> {
    /// Page title (e.g. "graphpp train: tiny, zbv p=2 v=2 m=8").
    pub title: String,
    /// Strategy rows, `(label, value)`, in display order: model (name, layers, parameters),
    /// schedule kind, p, v, m, B, T, layer split, recompute, dtype, learning rate, seed, data, run id.
    pub strategy: Vec<(String, String)>,
    /// Every step of the run, in step order; those with `val_loss` are the evaluations.
    pub steps: &'a [StepRecord],
    /// Measured timeline of the last steps (seconds), if recorded.
    pub measured: Option<Timeline>,
    /// The simulator's timeline for the same schedule from the measured per-action times
    /// (`graphpp_schedule::measured::measured_vs_predicted(..).predicted.timeline`).
    pub predicted: Option<Timeline>,
}

/// Errors of [`write`], naming the path.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// Creating the folder or writing the page failed.
    #[error("--report {path}: {source}")]
    Io {
        /// The folder or file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// Writes [`render`]`(r)` to `dir/index.html` (atomically; `dir` is created if missing) and returns
/// the page's path.
///
/// # Errors
/// [`ReportError::Io`] naming `dir` (cannot create it) or the page (cannot write it).
pub fn write(dir: &Path, r: &RunReport) -> Result<PathBuf, ReportError> {
    std::fs::create_dir_all(dir).map_err(|source| ReportError::Io { path: dir.to_path_buf(), source })?;
    let page = dir.join("index.html");
    crate::checkpoint::write_file_atomic(&page, render(r).as_bytes())
        .map_err(|source| ReportError::Io { path: page.clone(), source })?;
    Ok(page)
}

/// The report as one HTML page (UTF-8). Every string of `r` is escaped.
pub fn render(r: &RunReport) -> String {
    let mut h = String::new();
    let title = esc(&r.title);
    let _ = write!(
        h,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{title}</title>\n<style>{CSS}</style></head>\n<body>\n<h1>{title}</h1>\n"
    );
    h.push_str("<h2>Strategy</h2>\n<table class=\"strategy\">\n");
    for (k, v) in &r.strategy {
        let _ = writeln!(h, "<tr><th>{}</th><td>{}</td></tr>", esc(k), esc(v));
    }
    h.push_str("</table>\n");
    if let (Some(first), Some(last)) = (r.steps.first(), r.steps.last()) {
        let _ = writeln!(
            h,
            "<p>steps {}–{}: last train loss {}, {} s of training</p>",
            first.step,
            last.step,
            num(last.loss, 4),
            num(last.elapsed_s, 1)
        );
    }
    let pts = |f: &dyn Fn(&StepRecord) -> Option<f64>| -> Vec<(f64, f64)> {
        r.steps.iter().filter_map(|s| f(s).map(|y| (s.step as f64, y))).collect()
    };
    h.push_str("<h2>Loss</h2>\n");
    h.push_str(&line_chart(
        "loss (nats/byte)",
        &[
            Series { name: "train loss", color: "#1f77b4", markers: false, points: pts(&|s| Some(s.loss)) },
            Series { name: "validation loss", color: "#d62728", markers: true, points: pts(&|s| s.val_loss) },
        ],
    ));
    h.push_str("<h2>Throughput</h2>\n");
    h.push_str(&line_chart(
        "tokens/s",
        &[Series {
            name: "tokens/s",
            color: "#2ca02c",
            markers: false,
            points: pts(&|s| Some(s.tokens_per_s)),
        }],
    ));
    if r.measured.is_some() || r.predicted.is_some() {
        h.push_str("<h2>Measured vs simulated timeline</h2>\n");
        let captions = [
            (&r.measured, "Measured: the last steps as run (seconds)."),
            (
                &r.predicted,
                "Predicted: the simulator on the same schedule with the measured per-action times.",
            ),
        ];
        for (t, caption) in captions {
            if let Some(t) = t {
                let _ = writeln!(h, "<figure><figcaption>{caption}</figcaption><div class=\"timeline\">");
                h.push_str(&svg(t));
                h.push_str("</div></figure>\n");
            }
        }
    }
    h.push_str("<h2>Evaluations</h2>\n<table class=\"evals\">\n");
    h.push_str("<tr><th>step</th><th>train loss</th><th>val loss</th><th>tokens/s</th></tr>\n");
    for s in r.steps {
        if let Some(v) = s.val_loss {
            let _ = writeln!(h, "{}", eval_row(s.step, s.loss, v, s.tokens_per_s));
        }
    }
    h.push_str("</table>\n</body></html>\n");
    h
}

/// One row of the evaluations table: step, train loss and val loss (4 decimals), tokens/s (whole).
fn eval_row(step: u64, loss: f64, val_loss: f64, tokens_per_s: f64) -> String {
    format!(
        "<tr><td>{step}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
        num(loss, 4),
        num(val_loss, 4),
        num(tokens_per_s, 0)
    )
}

const CSS: &str = "body{font-family:system-ui,sans-serif;margin:2em;max-width:1300px;color:#222}\
table{border-collapse:collapse;margin:0.5em 0}th,td{border:1px solid #ccc;padding:3px 8px;text-align:left}\
table.evals td{text-align:right;font-variant-numeric:tabular-nums}\
svg.chart{width:100%;max-width:760px;height:auto}div.timeline{overflow-x:auto}\
figure{margin:1em 0}figcaption{font-size:0.9em;color:#555}";

/// `v` with `prec` decimals; `—` for NaN (`inf` stays `inf`).
fn num(v: f64, prec: usize) -> String {
    if v.is_nan() {
        "—".into()
    } else {
        format!("{v:.prec$}")
    }
}

/// One line of a chart.
struct Series<'s> {
    name: &'s str,
    color: &'s str,
    /// Draw a dot at each point (sparse series such as the validation loss).
    markers: bool,
    /// `(step, value)`, in step order.
    points: Vec<(f64, f64)>,
}

/// Keeps the finite points and thins them to at most [`MAX_POINTS`], first and last kept.
fn drawable(points: &[(f64, f64)]) -> Vec<(f64, f64)> {
    let ok = |v: f64| v.is_finite() && v.abs() <= HUGE;
    let p: Vec<_> = points.iter().copied().filter(|&(x, y)| ok(x) && ok(y)).collect();
    if p.len() <= MAX_POINTS {
        return p;
    }
    // Index i·(n−1)/(k−1): strictly increasing since n > k, 0 and n−1 included.
    (0..MAX_POINTS).map(|i| p[i * (p.len() - 1) / (MAX_POINTS - 1)]).collect()
}

/// `[lo, hi]` of `vals` (not empty, finite) widened by `frac` of its width on both sides; a constant
/// (or single) value gets ±max(10 % of it, `margin`) instead.
fn range(vals: impl Iterator<Item = f64>, margin: f64, frac: f64) -> (f64, f64) {
    let (lo, hi) = vals.fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), v| (l.min(v), h.max(v)));
    let pad = if hi - lo <= hi.abs().max(lo.abs()) * 1e-9 {
        (lo.abs() * 0.1).max(margin)
    } else {
        (hi - lo) * frac
    };
    (lo - pad, hi + pad)
}

/// Ticks of `[lo, hi]` at a 1-2-5 step (at least `min_step`): `(values, decimals for labels)`.
fn ticks(lo: f64, hi: f64, min_step: f64) -> (Vec<f64>, usize) {
    let raw = (hi - lo) / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let f = raw / mag;
    let step = (mag
        * if f < 1.5 {
            1.0
        } else if f < 3.0 {
            2.0
        } else if f < 7.0 {
            5.0
        } else {
            10.0
        })
    .max(min_step);
    let decimals = (-step.log10().floor()).clamp(0.0, 12.0) as usize;
    let (a, b) = ((lo / step).ceil() as i64, (hi / step).floor() as i64);
    ((a..=b).take(50).map(|k| k as f64 * step).collect(), decimals)
}

/// An inline SVG line chart of `series` over steps, with axes, tick labels and a legend. A series
/// is one `<polyline data-series="NAME">` in plot coordinates; the plot area is the
/// `<rect class="plot">`.
fn line_chart(y_label: &str, series: &[Series]) -> String {
    let drawn: Vec<Vec<(f64, f64)>> = series.iter().map(|s| drawable(&s.points)).collect();
    let mut o = String::new();
    let _ = writeln!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" class="chart" viewBox="0 0 {CHART_W} {CHART_H}" width="{CHART_W}" height="{CHART_H}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(
        o,
        r##"<rect class="plot" x="{LEFT}" y="{TOP}" width="{PLOT_W}" height="{PLOT_H}" fill="#fafafa" stroke="#888"/>"##
    );
    if drawn.iter().all(|d| d.is_empty()) {
        let _ = writeln!(
            o,
            r#"<text x="{}" y="{}" text-anchor="middle">no data</text>"#,
            LEFT + PLOT_W / 2.0,
            TOP + PLOT_H / 2.0
        );
        o.push_str("</svg>\n");
        return o;
    }
    let all = || drawn.iter().flatten();
    let (x0, x1) = range(all().map(|p| p.0), 0.5, 0.0);
    let (y0, y1) = range(all().map(|p| p.1), 1.0, 0.05);
    let plot = Plot { x0, x1, y0, y1 };
    axes(&mut o, &plot, y_label);
    for (i, (s, pts)) in series.iter().zip(&drawn).enumerate() {
        let lx = LEFT + PLOT_W - 150.0 * (series.len() - i) as f64;
        draw_series(&mut o, &plot, s, pts, lx);
    }
    o.push_str("</svg>\n");
    o
}

/// The data ranges of a chart's plot area, `[x0, x1]` steps by `[y0, y1]` values.
struct Plot {
    x0: f64,
    x1: f64,
    y0: f64,
    y1: f64,
}

impl Plot {
    /// The SVG x coordinate of step `x`.
    fn px(&self, x: f64) -> f64 {
        LEFT + (x - self.x0) / (self.x1 - self.x0) * PLOT_W
    }

    /// The SVG y coordinate of value `y` (up is larger).
    fn py(&self, y: f64) -> f64 {
        TOP + PLOT_H - (y - self.y0) / (self.y1 - self.y0) * PLOT_H
    }
}

/// Writes the axes of `plot` to `o`: step ticks (whole steps at least) below the plot area, value
/// ticks with grid lines on its left, and the labels `step` and `y_label`.
fn axes(o: &mut String, plot: &Plot, y_label: &str) {
    let (xt, xd) = ticks(plot.x0, plot.x1, 1.0);
    for t in xt {
        let x = plot.px(t);
        let _ = writeln!(
            o,
            r##"<line x1="{x:.1}" y1="{b}" x2="{x:.1}" y2="{b2}" stroke="#888"/><text x="{x:.1}" y="{ty}" text-anchor="middle">{t:.xd$}</text>"##,
            b = TOP + PLOT_H,
            b2 = TOP + PLOT_H + 4.0,
            ty = TOP + PLOT_H + 16.0
        );
    }
    let (yt, yd) = ticks(plot.y0, plot.y1, 0.0);
    for t in yt {
        let y = plot.py(t);
        let _ = writeln!(
            o,
            r##"<line x1="{LEFT}" y1="{y:.1}" x2="{r}" y2="{y:.1}" stroke="#e4e4e4"/><text x="{tx}" y="{ty:.1}" text-anchor="end">{t:.yd$}</text>"##,
            r = LEFT + PLOT_W,
            tx = LEFT - 6.0,
            ty = y + 4.0
        );
    }
    let _ = writeln!(
        o,
        r#"<text x="{}" y="{}" text-anchor="middle">step</text><text x="14" y="{}" text-anchor="middle" transform="rotate(-90 14 {})">{}</text>"#,
        LEFT + PLOT_W / 2.0,
        CHART_H - 8.0,
        TOP + PLOT_H / 2.0,
        TOP + PLOT_H / 2.0,
        esc(y_label)
    );
}

/// Writes series `s` to `o`: its drawable points `pts` as a polyline in `plot` (with a dot at each
/// point for a series with markers or a single point) and its legend entry at x `lx` above the
/// plot area.
fn draw_series(o: &mut String, plot: &Plot, s: &Series, pts: &[(f64, f64)], lx: f64) {
    let coords: Vec<String> =
        pts.iter().map(|&(x, y)| format!("{:.1},{:.1}", plot.px(x), plot.py(y))).collect();
    let _ = writeln!(
        o,
        r#"<polyline data-series="{}" fill="none" stroke="{}" stroke-width="1.5" points="{}"/>"#,
        esc(s.name),
        s.color,
        coords.join(" ")
    );
    if s.markers || pts.len() == 1 {
        for &(x, y) in pts {
            let _ = writeln!(
                o,
                r#"<circle cx="{:.1}" cy="{:.1}" r="2.5" fill="{}"/>"#,
                plot.px(x),
                plot.py(y),
                s.color
            );
        }
    }
    let ly = TOP - 14.0;
    let _ = writeln!(
        o,
        r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{}" stroke-width="2"/><text x="{}" y="{}">{}</text>"#,
        lx + 20.0,
        s.color,
        lx + 24.0,
        ly + 4.0,
        esc(s.name)
    );
}
