//! docs/ARCHITECTURE.md figures for ZB-H1, ZB-H2, ZB auto, grouped interleaving and DualPipe(V), measured with
//! the crate's simulator (`simulate`) on generated schedules; and a cross-check of the simulator
//! against the test-side replay in `common`. Unit costs T_F = T_I = T_W = 1, T_B = 2, c = 0 unless
//! said; memory M_B = 1, M_W = 0.5.

mod common;

use graphpp_schedule::{generate, simulate, Costs, Kind, Memory, Options, Schedule, Shape, SimReport};
use proptest::prelude::*;

fn gen(kind: Kind, shape: Shape, opts: &Options) -> Schedule {
    generate(kind, &shape, opts).unwrap_or_else(|e| panic!("{e}"))
}

fn sim(s: &Schedule, costs: Costs) -> SimReport {
    simulate(s, &costs, &Memory::default()).unwrap_or_else(|e| panic!("{e}"))
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

#[test]
fn zb_h1_p4_m8_idle_3_and_memory_per_stage() {
    let r = sim(&gen(Kind::ZbH1, Shape::new(4, 1, 8), &Options::default()), Costs::default());
    assert_eq!(r.busy, vec![24.0; 4]);
    assert_eq!(r.idle, vec![3.0; 4]);
    assert_eq!(r.makespan, 27.0);
    assert_eq!(r.peak_in_flight, vec![4, 3, 2, 1]);
    // Tutorial seed, "ZB-H1 的推导": stage i (from 1) peaks at (p−i+1)·M_B + (i−1)·M_W ≤ p·M_B.
    let want: Vec<f64> = (0..4).map(|r| (4 - r) as f64 + r as f64 * 0.5).collect();
    assert_eq!(r.peak_activations, want);
}

#[test]
fn zb_h1_bubble_closed_form_with_unequal_costs() {
    // (p−1)(T_F + T_I − T_W): T_F=3, T_I=2, T_W=1 → 4(p−1).
    let c = Costs { f: 3.0, i: 2.0, w: 1.0, b: 3.0, ..Costs::default() };
    for p in [2, 3, 5] {
        let r = sim(&gen(Kind::ZbH1, Shape::new(p, 1, 2 * p + 1), &Options::default()), c);
        for idle in &r.idle {
            assert!(close(*idle, 4.0 * (p as f64 - 1.0)), "p={p}: {:?}", r.idle);
        }
    }
}

#[test]
fn zb_h2_zero_steady_state_bubble_and_2p_minus_1_memory() {
    for (p, m) in [(2, 4), (4, 8), (4, 13), (6, 12), (8, 24)] {
        let r = sim(&gen(Kind::ZbH2, Shape::new(p, 1, m), &Options::default()), Costs::default());
        assert!(r.steady_idle.iter().all(|&x| close(x, 0.0)), "p={p} m={m}: {:?}", r.steady_idle);
        for (rank, &n) in r.peak_in_flight.iter().enumerate() {
            assert!(n < 2 * (p - rank), "p={p} m={m} rank {rank}: {n} in flight");
        }
        // (2p−1)·M_B at most, and the first stage does fill its 2p−1 slots.
        assert_eq!(r.peak_in_flight[0], 2 * p - 1);
        assert!(
            r.peak_activations.iter().all(|&x| x <= (2 * p - 1) as f64 + 1e-9),
            "{:?}",
            r.peak_activations
        );
    }
}

#[test]
fn zb_auto_2p_zero_steady_bubble_and_1p_within_the_cap() {
    for (p, m) in [(2, 4), (4, 8), (4, 16), (8, 16)] {
        let two_p = Options { mem_cap: Some(2.0 * p as f64), ..Options::default() };
        let r = sim(&gen(Kind::ZbAuto, Shape::new(p, 1, m), &two_p), Costs::default());
        assert!(r.steady_idle.iter().all(|&x| close(x, 0.0)), "ZB-2p p={p} m={m}: {:?}", r.steady_idle);
        assert!(r.peak_activations.iter().all(|&x| x <= 2.0 * p as f64 + 1e-9));
        let one_p = sim(&gen(Kind::ZbAuto, Shape::new(p, 1, m), &Options::default()), Costs::default());
        assert!(one_p.peak_activations.iter().all(|&x| x <= p as f64 + 1e-9), "{:?}", one_p.peak_activations);
        let h1 = sim(&gen(Kind::ZbH1, Shape::new(p, 1, m), &Options::default()), Costs::default());
        assert!(one_p.makespan <= h1.makespan, "ZB-1p {} vs ZB-H1 {}", one_p.makespan, h1.makespan);
    }
}

#[test]
fn zb_auto_uses_real_costs_and_latency() {
    // With c > 0 and unequal costs, the heuristic schedules against the costs it is given: it is no
    // slower than ZB-H1 (a fixed order) under the same costs and cap, and stays under the cap.
    for (p, m, c) in [(4, 12, 0.5), (4, 8, 1.0), (6, 18, 0.25)] {
        let costs = Costs { f: 1.0, i: 1.5, w: 0.5, b: 2.0, comm: c, ..Costs::default() };
        let opts = Options { costs, ..Options::default() };
        let auto = sim(&gen(Kind::ZbAuto, Shape::new(p, 1, m), &opts), costs);
        let h1 = sim(&gen(Kind::ZbH1, Shape::new(p, 1, m), &opts), costs);
        assert!(
            auto.makespan <= h1.makespan + 1e-9,
            "p={p} m={m} c={c}: {} vs {}",
            auto.makespan,
            h1.makespan
        );
        assert!(auto.peak_activations.iter().all(|&x| x <= p as f64 + 1e-9));
    }
}

#[test]
fn grouped_interleaved_bubble_and_peak() {
    // Interleaved: (p−1)(t_f+t_b)/v per rank; with chunk costs halved (v=2): 4.5 at p=4. Grouping
    // leaves the bubble unchanged; N = p has stage-0 peak p + (p−1)/v = 5.5, larger N holds more.
    let c = Costs { f: 0.5, b: 1.0, i: 0.5, w: 0.5, ..Costs::default() };
    let mut peaks = Vec::new();
    for n in [4, 8, 16] {
        let opts = Options { group: Some(n), ..Options::default() };
        let r = sim(&gen(Kind::GroupedInterleaved, Shape::new(4, 2, 16), &opts), c);
        assert!(r.idle.iter().all(|&x| close(x, 4.5)), "N={n}: {:?}", r.idle);
        peaks.push(r.peak_activations[0]);
    }
    assert_eq!(peaks, [5.5, 7.5, 11.5]);
}

#[test]
fn dualpipe_peak_in_flight_p_plus_1() {
    for (p, m) in [(2, 4), (4, 8), (6, 16), (8, 20)] {
        let r = sim(&gen(Kind::DualPipe, Shape::new(p, 2, m), &Options::default()), Costs::default());
        assert!(r.peak_in_flight.iter().all(|&n| n <= p + 1), "{:?}", r.peak_in_flight);
        assert!(r.idle.iter().all(|&x| close(x, p as f64 - 2.0)), "{:?}", r.idle);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// The simulator and the test-side replay agree on every rank's timeline for these kinds.
    #[test]
    fn simulator_agrees_with_replay(k in 0usize..6, p in 1usize..6, extra in 0usize..6) {
        let (kind, shape, opts) = match k {
            0 => (Kind::ZbH1, Shape::new(p, 1, p + extra), Options::default()),
            1 => (Kind::ZbH2, Shape::new(p, 1, p + extra), Options::default()),
            2 => (Kind::ZbAuto, Shape::new(p, 1, p + extra), Options::default()),
            3 => (Kind::GroupedInterleaved, Shape::new(p, 2, 2 * p), Options { group: Some(p), ..Options::default() }),
            4 => (Kind::DualPipe, Shape::new(2 * p, 2, 4 * p + 2 * extra), Options::default()),
            _ => (Kind::DualPipeV, Shape::new(p, 2, 2 * p + extra), Options::default()),
        };
        let s = gen(kind, shape, &opts);
        let r = sim(&s, Costs::default());
        let t = common::replay(&s, common::UNIT).map_err(TestCaseError::fail)?;
        prop_assert!(close(r.makespan, t.makespan()), "{}: {} vs {}", kind, r.makespan, t.makespan());
        for rank in 0..s.num_ranks() {
            prop_assert!(close(r.busy[rank], t.busy[rank]));
            prop_assert!(close(r.steady_idle[rank], t.steady_bubble(rank)));
        }
    }
}
