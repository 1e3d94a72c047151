//! zb-auto, zbv-auto and the fixed zbv order against the zero-bubble authors' reference heuristics
//! on their grid (the committed fixtures of `tests/fixtures/`, see `tools/zero_bubble/`), and the
//! time zbv-auto takes to build a large schedule.
//!
//! Run: `cargo run --release -p graphpp-schedule --example zb_grid`

use std::time::Instant;

use graphpp_schedule::*;
use serde_json::Value;

/// Per cell: (p, m, costs, cap, reference makespan).
fn cells(text: &str) -> Vec<(usize, usize, Costs, Option<f64>, f64)> {
    let v: Value = serde_json::from_str(text).expect("fixture is JSON");
    let num = |c: &Value, k: &str| c[k].as_f64().expect("numeric field");
    v["cells"]
        .as_array()
        .expect("cells")
        .iter()
        .map(|c| {
            let (i, w) = (num(c, "i"), num(c, "w"));
            let costs = Costs { f: num(c, "f"), i, w, b: i + w, comm: num(c, "c"), ..Costs::default() };
            (num(c, "p") as usize, num(c, "m") as usize, costs, c["cap"].as_f64(), num(c, "makespan"))
        })
        .collect()
}

fn makespan(kind: Kind, shape: Shape, costs: &Costs, mem_cap: Option<f64>) -> f64 {
    let s =
        generate(kind, &shape, &Options { costs: *costs, mem_cap, ..Options::default() }).expect("generates");
    simulate(&s, costs, &Memory::default()).expect("simulates").makespan
}

/// Prints how `kind` compares with the reference over `cells`.
fn report(kind: Kind, v: usize, cells: &[(usize, usize, Costs, Option<f64>, f64)]) {
    let (mut faster, mut slower, mut best, mut worst) = (0, 0, 0.0f64, 0.0f64);
    for (p, m, costs, cap, reference) in cells {
        let cap = if kind == Kind::Zbv { None } else { *cap };
        let ours = makespan(kind, Shape::new(*p, v, *m), costs, cap);
        let gain = 1.0 - ours / reference;
        faster += usize::from(gain > 1e-9);
        slower += usize::from(gain < -1e-9);
        best = best.max(gain);
        worst = worst.min(gain);
    }
    println!(
        "{:<9} vs reference: faster in {faster:>3}, slower in {slower:>3} of {} cells; best {:+.1}%, worst {:+.1}% makespan",
        kind.name(),
        cells.len(),
        -best * 100.0,
        -worst * 100.0
    );
}

fn main() {
    let zbv = cells(include_str!("../tests/fixtures/zbv_reference.json"));
    let zb = cells(include_str!("../tests/fixtures/zb_reference.json"));
    report(Kind::ZbAuto, 1, &zb);
    report(Kind::ZbvAuto, 2, &zbv);
    report(Kind::Zbv, 2, &zbv);
    for (p, m) in [(8, 32), (16, 64), (64, 1024)] {
        let t = Instant::now();
        let s = generate(Kind::ZbvAuto, &Shape::new(p, 2, m), &Options::default()).expect("generates");
        println!(
            "zbv-auto p={p} m={m}: {} actions built in {:.1} ms",
            s.actions().count(),
            t.elapsed().as_secs_f64() * 1e3
        );
    }
}
