//! Per-pass times of generate → lower → validate → simulate (the target shape by default).
//! The last row lowers with the `add_send_recv` pass alone: the compute-only schedule is not
//! validated on its own, the lowered one is (what a pipeline that only keeps the lowered schedule
//! needs; `lower` validates its input because it may be called on its own).
//!
//! Run: `cargo run --release -p graphpp-schedule --example prof -- [p v m [repeats]]`
//! (defaults 64 2 1024, 3 repeats; each figure is the fastest repeat, in milliseconds).
//! `PROF_KIND=zbv` (or `interleaved-1f1b`) runs only the whole pipeline of that kind `repeats`
//! times, for `perf stat -e task-clock` on a busy machine (CPU time is steadier than wall time).

use std::time::{Duration, Instant};

use graphpp_schedule::*;

/// Runs `f` and adds its time to `slot` keeping the fastest.
fn time<T>(slot: &mut Duration, f: impl FnOnce() -> T) -> T {
    let t = Instant::now();
    let out = f();
    *slot = (*slot).min(t.elapsed());
    out
}

const PASSES: [&str; 11] = [
    "generate",
    "validate(compute-only)",
    "add_send_recv",
    "lower (validate + add_send_recv)",
    "validate(lowered)",
    "DepGraph::build",
    "topo_order",
    "simulate",
    "Validated::simulate (validation's walk)",
    "total: generate+lower+validated+simulate",
    "total, lowered by add_send_recv alone",
];

fn profile(kind: Kind, shape: &Shape, repeats: usize) -> [Duration; 11] {
    let mut t = [Duration::MAX; 11];
    for _ in 0..repeats {
        let s = time(&mut t[0], || generate(kind, shape, &Options::default()).unwrap());
        time(&mut t[1], || validate(&s, &ValidateOptions::default()).unwrap());
        time(&mut t[2], || lower::add_send_recv(&s).unwrap());
        let l = time(&mut t[3], || lower(&s, &LowerOptions::default()).unwrap());
        let summary = time(&mut t[4], || validate(&l, &ValidateOptions::default()).unwrap());
        let g = time(&mut t[5], || deps::DepGraph::build(&l).unwrap());
        time(&mut t[6], || g.topo_order().unwrap());
        time(&mut t[7], || simulate(&l, &Costs::default(), &Memory::default()).unwrap());
        let v = validated(&l, &ValidateOptions::default()).unwrap();
        time(&mut t[8], || v.simulate(&Costs::default(), &Memory::default()).unwrap());
        drop(v);
        time(&mut t[9], || pipeline(kind, shape));
        time(&mut t[10], || {
            let s = generate(kind, shape, &Options::default()).unwrap();
            let l = lower::add_send_recv(&s).unwrap();
            let v = validated(&l, &ValidateOptions::default()).unwrap();
            v.simulate(&Costs::default(), &Memory::default()).unwrap()
        });
        eprintln!("{kind}: {summary}");
    }
    t
}

/// The whole pipeline: generate, lower, validate (keeping the walk), simulate on that walk.
fn pipeline(kind: Kind, shape: &Shape) -> SimReport {
    let s = generate(kind, shape, &Options::default()).unwrap();
    let l = lower(&s, &LowerOptions::default()).unwrap();
    let v = validated(&l, &ValidateOptions::default()).unwrap();
    v.simulate(&Costs::default(), &Memory::default()).unwrap()
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).map(|a| a.parse().expect("a number")).collect();
    let arg = |i: usize, d: usize| args.get(i).copied().unwrap_or(d);
    let shape = Shape::new(arg(0, 64), arg(1, 2), arg(2, 1024));
    let repeats = arg(3, 3);
    if let Ok(kind) = std::env::var("PROF_KIND") {
        let kind: Kind = kind.parse().expect("a schedule kind");
        for _ in 0..repeats {
            pipeline(kind, &shape);
        }
        return;
    }
    let kinds = [Kind::Zbv, Kind::Interleaved1F1B];
    let rows: Vec<[Duration; 11]> = kinds.iter().map(|&k| profile(k, &shape, repeats)).collect();
    println!(
        "p={} v={} m={} (best of {repeats}, ms)",
        shape.ranks, shape.stages_per_rank, shape.microbatches
    );
    println!("{:<42}{:>12}{:>18}", "pass", kinds[0].name(), kinds[1].name());
    for (i, name) in PASSES.iter().enumerate() {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        println!("{name:<42}{:>12.1}{:>18.1}", ms(rows[0][i]), ms(rows[1][i]));
    }
}
