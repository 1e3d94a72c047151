//! `zb-auto --solver ilp` (the `ilp` feature): never slower than the heuristic, always valid and
//! under the cap, and optimal where every order can be tried.
#![cfg(feature = "ilp")]

use std::time::Duration;

use graphpp_schedule::generate::zb_ilp::{solve, IlpOutcome};
use graphpp_schedule::{
    generate, simulate, validate, Action, Costs, Kind, Memory, Options, Schedule, Shape, Solver,
    ValidateOptions,
};

fn costs(f: f64, i: f64, w: f64, c: f64) -> Costs {
    Costs { f, i, w, b: i + w, comm: c, ..Costs::default() }
}

fn peak(s: &Schedule, c: &Costs) -> f64 {
    let r = simulate(s, c, &Memory::default()).unwrap();
    r.peak_activations.iter().copied().fold(0.0, f64::max)
}

fn makespan(s: &Schedule, c: &Costs) -> f64 {
    simulate(s, c, &Memory::default()).unwrap().makespan
}

/// One cell: the ILP's schedule is valid, under the cap and not slower than the heuristic's, and
/// says so truthfully. Returns whether it is strictly faster.
fn ilp_cell(p: usize, m: usize, cap: f64) -> bool {
    let c = costs(1.0, 1.5, 0.7, 0.2);
    let opts = Options { costs: c, mem_cap: Some(cap), ..Options::default() };
    let shape = Shape::new(p, 1, m);
    let at = format!("p={p} m={m} {c} cap {cap}");
    let heuristic = generate(Kind::ZbAuto, &shape, &opts).unwrap();
    let r = solve(&shape, &opts, Duration::from_secs(1)).unwrap_or_else(|e| panic!("{at}: {e}"));
    validate(&r.schedule, &ValidateOptions::microbatches(m)).unwrap_or_else(|e| panic!("{at}: {e}"));
    let (ilp, heur) = (makespan(&r.schedule, &c), makespan(&heuristic, &c));
    assert_eq!(heur, r.heuristic_makespan, "{at}");
    assert_eq!(ilp, r.makespan, "{at}");
    assert!(ilp <= heur, "{at}: ILP {ilp} > heuristic {heur}");
    let top = peak(&r.schedule, &c);
    assert!(top <= cap + 1e-9, "{at}: peak {top} above the cap");
    assert_eq!(r.binaries, 3 * p * m * (m - 1) / 2, "{at}");
    let faster = ilp < heur - 1e-9;
    if faster {
        assert!(matches!(r.outcome, IlpOutcome::Optimal | IlpOutcome::TimeLimit), "{at}");
    } else {
        assert!(matches!(r.outcome, IlpOutcome::Heuristic { .. }), "{at}: {:?}", r.outcome);
    }
    faster
}

#[test]
fn the_ilp_is_never_slower_than_the_heuristic_valid_and_under_the_cap() {
    let (mut cells, mut faster) = (0, 0);
    for p in [2usize, 4, 8] {
        for m in [p, 2 * p, 4 * p] {
            // Half of ZB-1p's cap, ZB-1p's (p M_B), ZB-2p's (2p M_B).
            for cap in [(p as f64 / 2.0).max(1.5), p as f64, 2.0 * p as f64] {
                faster += usize::from(ilp_cell(p, m, cap));
                cells += 1;
            }
        }
    }
    eprintln!("the ILP beat the heuristic in {faster} of {cells} cells");
    assert!(faster > 0, "the ILP never improved on the heuristic in {cells} cells");
}

/// Every order of one stage's 3m actions with F_j before I_j before W_j for each j (the
/// dependencies), microbatches in any order.
fn all_stage_orders(s: usize, m: usize) -> Vec<Vec<Action>> {
    fn go(s: usize, done: &mut [usize], cur: &mut Vec<Action>, out: &mut Vec<Vec<Action>>) {
        if done.iter().all(|&d| d == 3) {
            out.push(cur.clone());
            return;
        }
        for j in 0..done.len() {
            if done[j] < 3 {
                cur.push([Action::f, Action::i, Action::w][done[j]](s, j));
                done[j] += 1;
                go(s, done, cur, out);
                done[j] -= 1;
                cur.pop();
            }
        }
    }
    let mut out = Vec::new();
    go(s, &mut vec![0; m], &mut Vec::new(), &mut out);
    out
}

/// Every order of one stage's F's, I's and W's that keeps each kind's microbatch order and
/// F_j before I_j before W_j (the ILP's space).
fn stage_orders(s: usize, m: usize) -> Vec<Vec<Action>> {
    fn go(s: usize, m: usize, n: [usize; 3], cur: &mut Vec<Action>, out: &mut Vec<Vec<Action>>) {
        if n[2] == m {
            out.push(cur.clone());
            return;
        }
        let choices = [(n[0] < m, 0), (n[1] < n[0], 1), (n[2] < n[1], 2)];
        for (ok, k) in choices {
            if ok {
                cur.push([Action::f, Action::i, Action::w][k](s, n[k]));
                let mut next = n;
                next[k] += 1;
                go(s, m, next, cur, out);
                cur.pop();
            }
        }
    }
    let mut out = Vec::new();
    go(s, m, [0; 3], &mut Vec::new(), &mut out);
    out
}

/// The least makespan over every combination of stage orders (`orders(stage, m)`) that runs (no
/// deadlock) and fits the cap.
fn brute_force(p: usize, m: usize, c: &Costs, cap: f64, orders: fn(usize, usize) -> Vec<Vec<Action>>) -> f64 {
    let orders: Vec<Vec<Vec<Action>>> = (0..p).map(|s| orders(s, m)).collect();
    let mut pick = vec![0usize; p];
    let mut best = f64::INFINITY;
    loop {
        let s = Schedule::from_programs((0..p).map(|r| orders[r][pick[r]].clone()).collect());
        if let Ok(r) = simulate(&s, c, &Memory::default()) {
            if r.peak_activations.iter().all(|&a| a <= cap + 1e-9) {
                best = best.min(r.makespan);
            }
        }
        let Some(r) = (0..p).find(|&r| pick[r] + 1 < orders[r].len()) else { return best };
        pick[r] += 1;
        pick[..r].iter_mut().for_each(|x| *x = 0);
    }
}

#[test]
fn the_ilp_finds_the_optimum_where_every_order_can_be_tried() {
    assert_eq!(stage_orders(0, 3).len(), 42, "standard Young tableaux of shape 3×3");
    assert_eq!(all_stage_orders(0, 2).len(), 20, "two chains of 3 interleaved");
    let mut beat = 0;
    for (p, m) in [(2, 2), (3, 2), (2, 3), (3, 3)] {
        for c in [costs(1.0, 1.0, 1.0, 0.0), costs(1.0, 1.5, 0.7, 0.3), costs(2.0, 1.0, 3.0, 0.5)] {
            for cap in [1.0, 2.0, p as f64] {
                let opts = Options { costs: c, mem_cap: Some(cap), ..Options::default() };
                let at = format!("p={p} m={m} {c} cap {cap}");
                let optimum = brute_force(p, m, &c, cap, stage_orders);
                if m == 2 {
                    // Keeping each kind's microbatch order loses nothing: every order at all does
                    // no better (checked where there are few enough to try).
                    assert_eq!(brute_force(p, m, &c, cap, all_stage_orders), optimum, "{at}");
                }
                let r = solve(&Shape::new(p, 1, m), &opts, Duration::from_secs(20))
                    .unwrap_or_else(|e| panic!("{at}: {e}"));
                assert!((r.makespan - optimum).abs() < 1e-9, "{at}: ILP {} vs optimum {optimum}", r.makespan);
                assert!(r.proven_optimal, "{at}: {:?}", r.outcome);
                beat += usize::from(r.heuristic_makespan > optimum + 1e-9);
            }
        }
    }
    // The heuristic misses the optimum somewhere in this grid, so the equality above is the ILP's.
    assert!(beat > 0, "the heuristic was optimal everywhere: the test shows nothing of the ILP");
    eprintln!("the heuristic missed the optimum in {beat} cells");
}

#[test]
fn generate_with_the_ilp_solver_matches_solve_and_other_kinds_refuse_it() {
    let opts = Options {
        costs: costs(1.0, 1.5, 0.7, 0.3),
        mem_cap: Some(2.0),
        solver: Solver::Ilp { time_limit: Duration::from_secs(5) },
        ..Options::default()
    };
    let shape = Shape::new(3, 1, 3);
    let s = generate(Kind::ZbAuto, &shape, &opts).unwrap();
    assert_eq!(makespan(&s, &opts.costs), solve(&shape, &opts, Duration::from_secs(5)).unwrap().makespan);
    let e = generate(Kind::OneFOneB, &shape, &Options { mem_cap: None, ..opts }).unwrap_err();
    assert!(e.to_string().contains("--solver"), "{e}");
}

#[test]
fn the_cap_is_in_the_memory_model_s_units_and_huge_programs_are_refused() {
    // The same problem with M_B = 2: the same makespan, the same peak in M_B units.
    let c = costs(1.0, 1.5, 0.7, 0.2);
    let (unit, double) = (Memory::default(), Memory { m_b: 2.0, m_w: 1.0 });
    let shape = Shape::new(4, 1, 4);
    let run = |memory: Memory| {
        let opts = Options { costs: c, memory, mem_cap: Some(2.0), ..Options::default() };
        let r = solve(&shape, &opts, Duration::from_secs(20)).unwrap();
        let peak =
            simulate(&r.schedule, &c, &memory).unwrap().peak_activations.iter().copied().fold(0.0, f64::max);
        (r.makespan, r.heuristic_makespan, peak / memory.m_b)
    };
    let (a, b) = (run(unit), run(double));
    assert_eq!(a, b);
    assert!(a.0 < a.1 - 1.0, "the ILP beats the heuristic here: {a:?}");
    assert!(a.2 <= 2.0 + 1e-9, "peak {} M_B above the cap", a.2);
    let e = solve(&Shape::new(64, 1, 1024), &Options::default(), Duration::from_secs(1)).unwrap_err();
    assert!(e.to_string().contains("the limit is 200000"), "{e}");
}
