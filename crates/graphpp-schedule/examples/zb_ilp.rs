//! `zb-auto --solver ilp` against the heuristic: makespan, bubble and solve time on a grid of
//! shapes, costs and memory caps (the `ilp` feature).
//!
//! Run: `cargo run --release -p graphpp-schedule --features ilp --example zb_ilp [SECONDS]`
//! (SECONDS: HiGHS's time limit per cell, default 5).

use std::time::{Duration, Instant};

use graphpp_schedule::generate::zb_ilp::solve;
use graphpp_schedule::{Costs, Options, Shape};

fn main() {
    let secs: f64 = std::env::args().nth(1).map_or(5.0, |a| a.parse().expect("SECONDS is a number"));
    let limit = Duration::from_secs_f64(secs);
    println!("p  m   T_F/T_I/T_W/c        cap   heuristic  ilp        gain    outcome                 s");
    for p in [2usize, 4, 8] {
        for m in [p, 2 * p, 4 * p] {
            for (f, i, w, c) in [(1.0, 1.0, 1.0, 0.0), (1.0, 1.5, 0.7, 0.2)] {
                let costs = Costs { f, i, w, b: i + w, comm: c, ..Costs::default() };
                for cap in [(p as f64 / 2.0).ceil().max(2.0), p as f64, 2.0 * p as f64] {
                    let opts = Options { costs, mem_cap: Some(cap), ..Options::default() };
                    let t = Instant::now();
                    let r = solve(&Shape::new(p, 1, m), &opts, limit).expect("solves");
                    let gain = 1.0 - r.makespan / r.heuristic_makespan;
                    println!(
                        "{p:<2} {m:<3} {f}/{i}/{w}/{c:<12} {cap:<5} {:<10.3} {:<10.3} {:>5.1}%  {:<23} {:.2}",
                        r.heuristic_makespan,
                        r.makespan,
                        gain * 100.0,
                        format!("{:?}", r.outcome).chars().take(23).collect::<String>(),
                        t.elapsed().as_secs_f64()
                    );
                }
            }
        }
    }
}
