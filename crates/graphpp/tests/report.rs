//! The run report page (`graphpp::report`): well-formed SVG, one table row per evaluation,
//! chart coordinates inside the plot, escaping, non-finite values, the write error.

use std::path::Path;

use graphpp::metrics::StepRecord;
use graphpp::report::{render, write, ReportError, RunReport, MAX_POINTS};
use graphpp_schedule::{simulate, Costs, Memory, Schedule};

fn rec(step: u64, loss: f64, val_loss: Option<f64>, tokens_per_s: f64) -> StepRecord {
    StepRecord {
        step,
        loss,
        lr: 1e-3,
        grad_norm: 0.5,
        step_s: 0.2,
        tokens_per_s,
        elapsed_s: step as f64 * 0.2,
        val_loss,
        peak_bytes: None,
        resident_bytes: None,
        boundary_wait_s: None,
        flops_per_s: None,
        aux_loss: None,
        mtp_loss: None,
    }
}

/// `n` steps with a falling loss and an evaluation every 10 steps.
fn steps(n: u64) -> Vec<StepRecord> {
    (1..=n)
        .map(|s| {
            rec(
                s,
                5.0 / (1.0 + s as f64 / 20.0),
                s.is_multiple_of(10).then(|| 4.0 - s as f64 / 1000.0),
                20000.0 + s as f64,
            )
        })
        .collect()
}

fn report(steps: &[StepRecord]) -> RunReport<'_> {
    RunReport {
        title: "graphpp train: tiny, zbv p=2 v=2 m=8".into(),
        strategy: vec![
            ("model".into(), "tiny (4 layers, 0.23M parameters)".into()),
            ("schedule".into(), "zbv".into()),
        ],
        steps,
        measured: None,
        predicted: None,
    }
}

/// Every `<svg>…</svg>` block of `page`.
fn svg_blocks(page: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = page;
    while let Some(i) = rest.find("<svg") {
        let end = rest[i..].find("</svg>").expect("an <svg> block is closed") + i + "</svg>".len();
        out.push(&rest[i..end]);
        rest = &rest[end..];
    }
    out
}

/// A chart's plot area: `(x, y, width, height)`.
type Plot = (f64, f64, f64, f64);

/// The plot area and the points of series `name` in the first chart that has it.
fn series(page: &str, name: &str) -> (Plot, Vec<(f64, f64)>) {
    for block in svg_blocks(page) {
        let doc = roxmltree::Document::parse(block).unwrap();
        let Some(line) = doc.descendants().find(|n| n.attribute("data-series") == Some(name)) else {
            continue;
        };
        let plot = doc.descendants().find(|n| n.attribute("class") == Some("plot")).unwrap();
        let a = |k| plot.attribute(k).unwrap().parse::<f64>().unwrap();
        let pts = line
            .attribute("points")
            .unwrap()
            .split_whitespace()
            .map(|p| {
                let (x, y) = p.split_once(',').unwrap();
                (x.parse().unwrap(), y.parse().unwrap())
            })
            .collect();
        return ((a("x"), a("y"), a("width"), a("height")), pts);
    }
    panic!("no series {name}")
}

fn assert_inside_and_monotone(plot: Plot, pts: &[(f64, f64)]) {
    let (x, y, w, h) = plot;
    for &(px, py) in pts {
        assert!(px >= x && px <= x + w && py >= y && py <= y + h, "({px}, {py}) outside {plot:?}");
    }
    assert!(pts.windows(2).all(|p| p[0].0 < p[1].0), "x not increasing: {pts:?}");
}

#[test]
fn every_svg_block_parses_as_xml() {
    let s = Schedule::from_csv("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n").unwrap();
    let t = simulate(&s, &Costs::default(), &Memory::default()).unwrap().timeline;
    let st = steps(30);
    let mut r = report(&st);
    r.measured = Some(t.clone());
    r.predicted = Some(t);
    let page = render(&r);
    let blocks = svg_blocks(&page);
    assert_eq!(blocks.len(), 4, "loss, tokens/s, measured, predicted");
    // The loss axis says what the CLI says: the tokens are bytes.
    assert!(blocks[0].contains("loss (nats/byte)") && !page.contains("nats/token"), "{}", blocks[0]);
    for b in &blocks {
        roxmltree::Document::parse(b).unwrap_or_else(|e| panic!("{e}: {b}"));
    }
    assert_eq!(page.matches("0F1").count(), 4, "each action has a title and a label in both timelines");
    assert!(page.starts_with("<!DOCTYPE html>") && page.trim_end().ends_with("</html>"));
    // Nothing to run or fetch: no script, and every URL is the SVG namespace.
    assert!(!page.contains("<script"));
    assert_eq!(page.matches("http").count(), page.matches("\"http://www.w3.org/2000/svg\"").count());
}

#[test]
fn every_evaluation_has_a_row() {
    let st = vec![
        rec(1, 5.54321, None, 100.4),
        rec(2, 3.0, Some(3.25), 22942.6),
        rec(3, 2.5, None, 1.0),
        rec(4, 2.31574, Some(2.34606), 23159.0),
    ];
    let page = render(&report(&st));
    let table = &page[page.find("<table class=\"evals\">").unwrap()..];
    let rows: Vec<&str> = table.lines().filter(|l| l.starts_with("<tr><td>")).collect();
    assert_eq!(
        rows,
        [
            "<tr><td>2</td><td>3.0000</td><td>3.2500</td><td>22943</td></tr>",
            "<tr><td>4</td><td>2.3157</td><td>2.3461</td><td>23159</td></tr>",
        ]
    );
    assert!(page.contains("<tr><th>model</th><td>tiny (4 layers, 0.23M parameters)</td></tr>"), "{page}");
}

#[test]
fn the_loss_polyline_has_one_point_per_step_inside_the_plot() {
    let st = steps(37);
    let page = render(&report(&st));
    let (plot, pts) = series(&page, "train loss");
    assert_eq!(pts.len(), 37);
    assert_inside_and_monotone(plot, &pts);
    assert_eq!((pts[0].0, pts[36].0), (plot.0, plot.0 + plot.2), "steps 1 and 37 at the plot's edges");
    assert!(pts[0].1 < pts[36].1, "the falling loss's first point is higher up (smaller y)");
    let (_, val) = series(&page, "validation loss");
    assert_eq!(val.len(), 3);
    assert_eq!(series(&page, "tokens/s").1.len(), 37);
}

#[test]
fn thousands_of_steps_are_thinned_keeping_both_ends() {
    let st = steps(5001);
    let page = render(&report(&st));
    let (plot, pts) = series(&page, "train loss");
    assert_eq!(pts.len(), MAX_POINTS);
    assert_inside_and_monotone(plot, &pts);
    assert_eq!((pts[0].0, pts[MAX_POINTS - 1].0), (plot.0, plot.0 + plot.2));
    assert_eq!(series(&page, "validation loss").1.len(), 500, "sparse series are not thinned");
}

#[test]
fn one_point_and_constant_series_are_drawn_inside() {
    let one = [rec(7, 2.0, Some(2.5), 1000.0)];
    let page = render(&report(&one));
    let (plot, pts) = series(&page, "train loss");
    assert_eq!(pts.len(), 1);
    assert_inside_and_monotone(plot, &pts);
    assert_eq!(pts[0].0, plot.0 + plot.2 / 2.0, "a single step sits mid-axis");
    let flat: Vec<_> = (1..=10).map(|s| rec(s, 3.0, None, 0.0)).collect();
    let page = render(&report(&flat));
    let (plot, pts) = series(&page, "train loss");
    assert_inside_and_monotone(plot, &pts);
    assert!(pts.iter().all(|p| p.1 == plot.1 + plot.3 / 2.0), "a constant sits mid-height: {pts:?}");
    assert!(!page.contains("NaN") && !page.contains("inf"), "{page}");
    let none = render(&report(&[]));
    assert_eq!(svg_blocks(&none).len(), 2);
    assert!(none.contains(">no data</text>"));
}

#[test]
fn a_script_title_is_escaped() {
    let st = steps(3);
    let mut r = report(&st);
    r.title = "<script>alert(\"x&y\")</script>".into();
    r.strategy.push(("data's <b>".into(), "a&b".into()));
    let page = render(&r);
    assert!(!page.contains("<script"), "{page}");
    assert!(page.contains("<h1>&lt;script&gt;alert(&quot;x&amp;y&quot;)&lt;/script&gt;</h1>"), "{page}");
    assert!(page.contains("<tr><th>data&#39;s &lt;b&gt;</th><td>a&amp;b</td></tr>"), "{page}");
}

#[test]
fn non_finite_values_never_reach_the_page() {
    let mut st = steps(20);
    st[3].loss = f64::NAN;
    st[5].loss = f64::INFINITY;
    st[9].val_loss = Some(f64::NAN);
    st[19].loss = f64::NAN;
    st[7].tokens_per_s = f64::NEG_INFINITY;
    let page = render(&report(&st));
    assert!(!page.contains("NaN"), "{page}");
    let (plot, pts) = series(&page, "train loss");
    assert_eq!(pts.len(), 17);
    assert_inside_and_monotone(plot, &pts);
    assert_eq!(series(&page, "validation loss").1.len(), 1);
    assert_eq!(series(&page, "tokens/s").1.len(), 19);
    assert!(page.contains("<tr><td>10</td><td>3.3333</td><td>—</td><td>20010</td></tr>"), "{page}");
    assert!(page.contains("<tr><td>20</td><td>—</td><td>3.9800</td><td>20020</td></tr>"), "{page}");
}

#[test]
fn write_puts_the_page_in_the_folder() {
    let dir = tempfile::tempdir().unwrap();
    let st = steps(12);
    let out = dir.path().join("a/b");
    let page = write(&out, &report(&st)).unwrap();
    assert_eq!(page, out.join("index.html"));
    assert_eq!(std::fs::read_to_string(&page).unwrap(), render(&report(&st)));
    assert_eq!(std::fs::read_dir(&out).unwrap().count(), 1, "no temporary file left");
}

#[test]
fn write_to_an_unwritable_place_names_the_path() {
    let st = steps(2);
    let e = write(Path::new("/proc/graphpp-report"), &report(&st)).unwrap_err();
    let ReportError::Io { path, .. } = &e;
    assert_eq!(path, Path::new("/proc/graphpp-report"));
    assert!(e.to_string().starts_with("--report /proc/graphpp-report: "), "{e}");
}
