//! `zb-auto` and `zbv-auto` against the zero-bubble authors' reference heuristics, and unit-free
//! decisions of both.
//!
//! `tests/fixtures/zbv_reference.json` and `zb_reference.json` hold the references' schedules on
//! one grid (p ∈ {2, 4, 6, 8}, m ∈ {p, 2p, 3p, 4p}, four (T_F, T_I, T_W) sets, c ∈ {0, 0.1};
//! M_W = M_B/2; cap p M_B for ZB-V, p and 2p for ZB-1p/2p), written by
//! `tools/zero_bubble/{zbv,zb}_reference.py` from sail-sg/zero-bubble-pipeline-parallelism at
//! commit 39f2c186 (`zbv.py`, `zb.py`). CI needs no Python: the fixtures are committed.

use graphpp_schedule::{
    generate, simulate, validate, Action, Costs, Kind, Memory, Options, Schedule, Shape, SimReport,
    ValidateOptions,
};
use serde_json::Value;

/// One reference cell.
struct Cell {
    p: usize,
    m: usize,
    costs: Costs,
    /// The memory cap, M_B units (`None`: the generator's default p).
    cap: Option<f64>,
    makespan: f64,
    peak: f64,
    order: Schedule,
}

/// The ZB-V reference cells.
fn cells() -> Vec<Cell> {
    cells_of(include_str!("fixtures/zbv_reference.json"))
}

fn cells_of(text: &str) -> Vec<Cell> {
    let v: Value = serde_json::from_str(text).unwrap();
    let num = |c: &Value, k: &str| c[k].as_f64().unwrap_or_else(|| panic!("field {k}"));
    v["cells"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let order = c["order"]
                .as_array()
                .unwrap()
                .iter()
                .map(|row| row.as_str().unwrap().split(' ').map(|a| a.parse::<Action>().unwrap()).collect())
                .collect();
            Cell {
                p: num(c, "p") as usize,
                m: num(c, "m") as usize,
                costs: costs(num(c, "f"), num(c, "i"), num(c, "w"), num(c, "c")),
                cap: c["cap"].as_f64(),
                makespan: num(c, "makespan"),
                peak: num(c, "peak"),
                order: Schedule::from_programs(order),
            }
        })
        .collect()
}

fn costs(f: f64, i: f64, w: f64, c: f64) -> Costs {
    Costs { f, i, w, b: i + w, comm: c, ..Costs::default() }
}

fn scaled(c: &Costs, k: f64) -> Costs {
    costs(c.f * k, c.i * k, c.w * k, c.comm * k)
}

fn run(kind: Kind, shape: Shape, costs: &Costs) -> (Schedule, SimReport) {
    run_capped(kind, shape, costs, None)
}

fn run_capped(kind: Kind, shape: Shape, costs: &Costs, mem_cap: Option<f64>) -> (Schedule, SimReport) {
    let opts = Options { costs: *costs, mem_cap, ..Options::default() };
    let s = generate(kind, &shape, &opts).unwrap_or_else(|e| panic!("{kind} {shape:?}: {e}"));
    validate(&s, &ValidateOptions::microbatches(shape.microbatches))
        .unwrap_or_else(|e| panic!("{kind}: {e}"));
    let r = simulate(&s, costs, &Memory::default()).unwrap();
    (s, r)
}

fn peak(r: &SimReport) -> f64 {
    r.peak_activations.iter().copied().fold(0.0, f64::max)
}

#[test]
fn the_simulator_replays_the_reference_exactly() {
    let (v, zb) = (cells(), cells_of(include_str!("fixtures/zb_reference.json")));
    assert_eq!((v.len(), zb.len()), (128, 256));
    for c in v.iter().chain(&zb) {
        validate(&c.order, &ValidateOptions::microbatches(c.m)).unwrap();
        let r = simulate(&c.order, &c.costs, &Memory::default()).unwrap();
        assert!(
            (r.makespan - c.makespan).abs() < 1e-9,
            "p={} m={} {}: {} vs {}",
            c.p,
            c.m,
            c.costs,
            r.makespan,
            c.makespan
        );
        assert!((peak(&r) - c.peak).abs() < 1e-9, "p={} m={}: peak {} vs {}", c.p, c.m, peak(&r), c.peak);
    }
}

#[test]
fn zbv_auto_is_never_slower_than_the_reference_and_stays_under_the_cap() {
    let (mut faster, mut zbv_slower) = (0, 0);
    for c in cells() {
        let shape = Shape::new(c.p, 2, c.m);
        let (_, r) = run(Kind::ZbvAuto, shape, &c.costs);
        let at = format!("p={} m={} {}", c.p, c.m, c.costs);
        assert!(r.makespan <= c.makespan + 1e-9, "{at}: zbv-auto {} > reference {}", r.makespan, c.makespan);
        assert!(peak(&r) <= c.p as f64 + 1e-9, "{at}: peak {} above the cap {}", peak(&r), c.p);
        faster += usize::from(r.makespan < c.makespan - 1e-9);
        let (_, fixed) = run(Kind::Zbv, shape, &c.costs);
        zbv_slower += usize::from(fixed.makespan > c.makespan + 1e-9);
    }
    // The fixed PyTorch order loses to the reference in many cells (53 of 128 when measured).
    assert!(zbv_slower > 40, "zbv slower than the reference in only {zbv_slower} cells");
    eprintln!("zbv-auto faster than the reference in {faster} of 128 cells");
}

#[test]
fn zb_auto_is_never_slower_than_the_reference_and_stays_under_the_cap() {
    let mut faster = 0;
    for c in cells_of(include_str!("fixtures/zb_reference.json")) {
        let (_, r) = run_capped(Kind::ZbAuto, Shape::new(c.p, 1, c.m), &c.costs, c.cap);
        let (at, cap) = (format!("p={} m={} {} cap {:?}", c.p, c.m, c.costs, c.cap), c.cap.unwrap());
        assert!(r.makespan <= c.makespan + 1e-9, "{at}: zb-auto {} > reference {}", r.makespan, c.makespan);
        assert!(peak(&r) <= cap + 1e-9, "{at}: peak {} above the cap", peak(&r));
        faster += usize::from(r.makespan < c.makespan - 1e-9);
    }
    eprintln!("zb-auto faster than the reference in {faster} of 256 cells");
}

#[test]
fn zbv_auto_beats_the_fixed_order_where_m_equals_p() {
    // p = 8, m = 8, F = 1, I = 2, W = 1, c = 0 — zbv 92, the reference 78.
    let c = costs(1.0, 2.0, 1.0, 0.0);
    let (_, fixed) = run(Kind::Zbv, Shape::new(8, 2, 8), &c);
    let (_, auto) = run(Kind::ZbvAuto, Shape::new(8, 2, 8), &c);
    assert_eq!((fixed.makespan, auto.makespan), (92.0, 78.0));
}

/// Makespan at costs as given and at ×10, for one kind and shape; the two schedules are equal.
fn both_units(kind: Kind, shape: Shape, c: &Costs) -> (f64, f64) {
    let (one, ten) = (run(kind, shape, c), run(kind, shape, &scaled(c, 10.0)));
    assert_eq!(one.0, ten.0, "{kind} {shape:?} {c}: another schedule at costs ×10");
    (one.1.makespan, ten.1.makespan)
}

#[test]
fn memory_decisions_do_not_depend_on_the_cost_unit() {
    // M_W = 0.3: memory steps of 0.7 and 0.3 M_B that binary sums round; costs in nanoseconds.
    let memory = Memory { m_b: 1.0, m_w: 0.3 };
    for (kind, v) in [(Kind::ZbAuto, 1), (Kind::ZbvAuto, 2)] {
        for p in [2, 4, 6] {
            let shape = Shape::new(p, v, 3 * p);
            let build = |k: f64| {
                let c = scaled(&costs(1.0, 1.0, 1.0, 0.1), k);
                let opts = Options { costs: c, memory, mem_cap: Some(p as f64), ..Options::default() };
                let s = generate(kind, &shape, &opts).unwrap();
                (peak(&simulate(&s, &c, &memory).unwrap()), s)
            };
            let (small, large) = (build(1.0), build(1e8));
            assert_eq!(small.1, large.1, "{kind} p={p}: the schedule changes with the cost unit");
            assert!(large.0 <= p as f64 + 1e-9, "{kind} p={p}: peak {} above the cap", large.0);
        }
    }
}

#[test]
fn decisions_do_not_depend_on_the_cost_unit() {
    // The reference gives 14.3 for these costs and 13.4 for them ×10.
    let (one, ten) = both_units(Kind::ZbAuto, Shape::new(2, 1, 4), &costs(1.0, 1.0, 1.0, 0.1));
    assert!((one - 13.4).abs() < 1e-9 && (ten - 134.0).abs() < 1e-9, "{one} vs {ten}");
    for p in [2, 4, 6, 8] {
        for m in [p, 2 * p, 3 * p, 4 * p] {
            for (f, i, w) in [(1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (2.0, 2.0, 1.0), (1.0, 1.0, 2.0)] {
                for c in [0.0, 0.1] {
                    let k = costs(f, i, w, c);
                    for (kind, v) in [(Kind::ZbAuto, 1), (Kind::ZbvAuto, 2)] {
                        let (one, ten) = both_units(kind, Shape::new(p, v, m), &k);
                        assert!((one * 10.0 - ten).abs() < 1e-6, "{kind} p={p} m={m} {k}: {one} vs {ten}/10");
                    }
                }
            }
        }
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(96))]

    /// Every memory-aware generator builds for the memory model it is given: a valid schedule
    /// whose simulated peak (same M_W) stays within the cap, or a typed error when none fits.
    #[test]
    fn memory_aware_kinds_respect_the_cap_for_any_m_w(
        p in 1usize..7, m_factor in 1usize..4, cap_tenths in 10u32..90, m_w_tenths in 0u32..10,
        f in 1u32..4, i in 1u32..4, w in 1u32..4, c_tenths in 0u32..3, v_shape: bool,
    ) {
        let (kind, v) = if v_shape { (Kind::ZbvAuto, 2) } else { (Kind::ZbAuto, 1) };
        let m = m_factor * p;
        let memory = Memory { m_b: 1.0, m_w: f64::from(m_w_tenths) / 10.0 };
        let cap = f64::from(cap_tenths) / 10.0 * p as f64 / 2.0;
        let costs = costs(f64::from(f), f64::from(i), f64::from(w), f64::from(c_tenths) / 10.0);
        let opts = Options { costs, memory, mem_cap: Some(cap.max(1.0)), ..Options::default() };
        match generate(kind, &Shape::new(p, v, m), &opts) {
            Ok(s) => {
                validate(&s, &ValidateOptions::microbatches(m)).map_err(|e| proptest::test_runner::TestCaseError::fail(e.to_string()))?;
                let r = simulate(&s, &costs, &memory).unwrap();
                proptest::prop_assert!(peak(&r) <= cap.max(1.0) + 1e-9, "{} peak {} above cap {}", kind, peak(&r), cap);
            }
            Err(e) => proptest::prop_assert!(e.to_string().contains("memory cap"), "{}", e),
        }
        // The default cap (p M_B, 1F1B's peak) always serves m >= p.
        let default = Options { mem_cap: None, ..opts };
        proptest::prop_assert!(generate(kind, &Shape::new(p, v, m), &default).is_ok(), "{} default cap", kind);
    }
}
